"""The model's shape, read from a Hugging Face ``config.json`` dict (or GGUF metadata
turned into one). Torch-free; one place that knows the config's spellings."""

from __future__ import annotations

import math
from dataclasses import dataclass

# model_type -> what differs from plain Llama
SUPPORTED_ARCHITECTURES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},  # an RMSNorm over each head's q and k before RoPE
    "smollm": {},  # SmolLM is Llama; GGUF files call it llama too
    "phi3": {},  # Phi-3, Phi-3.5, Phi-4: q|k|v and gate|up fused in the checkpoint too; LongRoPE
    "granite": {},  # IBM Granite 3: Llama scaled (embeddings, each sublayer's output, scores, logits)
    # mixtures of experts: each layer's MLP is a router over experts (``engine/models/moe.py``, ``MoEConfig``);
    # Mixtral's experts are intermediate_size wide and its top-k weights always renormalized
    "mixtral": {"moe": True, "norm_topk_prob": True, "expert_width": "intermediate_size"},
    "qwen2_moe": {"moe": True, "attention_bias": True, "shared_expert": True},  # beside the routed ones
    "qwen3_moe": {"moe": True, "qk_norm": True},
    # Gemma: RMSNorm as x (1 + w), embeddings times sqrt(hidden), GELU, tied embeddings; 2 and 3 also norm
    # each sublayer's output (``engine/models/llama.py``'s GemmaDecoderLayer) and slide a window over some
    # layers; 2 caps scores
    "gemma": {"gemma": 1},
    "gemma2": {"gemma": 2},
    "gemma3_text": {"gemma": 3, "qk_norm": True},  # Gemma 3 1B; the larger ones are "gemma3" (``_gemma3_text``)
    # OLMo 2 and 3: no norm before a sublayer, one after each (``engine/models/llama.py``'s OlmoDecoderLayer);
    # q and k normed across all heads; 3 slides a window over three of each four layers
    "olmo2": {"olmo": True, "qk_norm": True},
    "olmo3": {"olmo": True, "qk_norm": True},
    # OpenAI's GPT-OSS: a mixture of experts whose router and experts have biases and whose experts' activation is a
    # clamped SwiGLU (``MoEConfig.swiglu``); attention sinks, an o_proj bias, a window over every other layer;
    # RMSNorm weights multiplied before the one rounding (OLMo's rule)
    "gpt_oss": {"moe": True, "attention_bias": True, "norm_topk_prob": True, "expert_width": "intermediate_size",
                "gpt_oss": True},
}
# BERT-style encoders (``engine/models/bert.py``, ``modernbert.py``): bidirectional attention over the whole prompt,
# no KV cache; they embed and classify (BERT, RoBERTa, XLM-R, MPNet, DistilBERT, ModernBERT: bge, e5, all-MiniLM,
# all-mpnet, gte-modernbert, bge-reranker, ms-marco cross-encoders, sentiment classifiers)
ENCODER_ARCHITECTURES = ("bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "modernbert")
# DistilBERT's config keys, as the others spell them (its LayerNorms' epsilon is fixed, its token types none)
_DISTILBERT_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                    "hidden_dim": "intermediate_size", "activation": "hidden_act"}
# what transformers' Gemma2Config and Gemma3TextConfig assume for keys a config.json leaves out
_GEMMA2_DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0, "rope_theta": 10_000.0, "max_position_embeddings": 8192}
_GEMMA3_DEFAULTS = {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "sliding_window": 4096, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}


@dataclass(frozen=True)
class QuantConfig:
    """An int4 checkpoint's ``quantization_config`` (``engine/quant.py`` reads its tensors)."""

    method: str  # "awq" (AutoAWQ's GEMM layout) or "gptq"
    group_size: int  # input columns sharing a scale and zero point; 0: all of them (-1 in the file)
    zero_offset: int  # added to each stored zero point: 1 in GPTQ's original format, which stores z - 1
    act_order: bool  # GPTQ's desc_act: groups follow g_idx, not the column order

    @classmethod
    def from_hf(cls, q: dict) -> QuantConfig:
        if not isinstance(q, dict):
            raise ValueError(f"quantization_config must be an object, got {q!r}")
        method = str(q.get("quant_method", "")).lower()
        if method not in ("awq", "gptq"):
            raise ValueError(f"unsupported quantization {method or q!r}: tokenmill loads AWQ and GPTQ int4 "
                             f"checkpoints (and GGUF files)")
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4 or isinstance(bits, bool):
            raise ValueError(f"{method.upper()} with bits {bits!r} is not supported: only 4-bit weights are")
        group = q.get("group_size", q.get("q_group_size", 128))
        if not isinstance(group, int) or isinstance(group, bool) or group != -1 and group <= 0:
            raise ValueError(f"{method.upper()} group_size must be a positive integer or -1, got {group!r}")
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm" or not q.get("zero_point", True):
                raise ValueError(f"AWQ version {version!r} with zero_point={q.get('zero_point', True)} is not "
                                 f"supported: only AutoAWQ's GEMM layout with zero points is")
            return cls("awq", max(group, 0), 0, False)
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2 are)")
        if q.get("pack_dtype", "int32") != "int32" or q.get("dynamic"):  # GPTQModel's options
            raise ValueError(f"GPTQ with pack_dtype {q.get('pack_dtype')!r} or per-module dynamic settings is not "
                             f"supported: only int32 words, one setting for every layer")
        act_order = q.get("desc_act", q.get("act_order", False))  # GPTQModel has spelled it both ways
        if not isinstance(act_order, bool):
            raise ValueError(f"GPTQ desc_act must be true or false, got {act_order!r}")
        return cls("gptq", max(group, 0), 1 if fmt == "gptq" else 0, act_order)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts' shape: each token goes to the ``top_k`` of ``num_experts`` experts (gated
    MLPs of width ``intermediate_size``) its router scores highest, their outputs weighted by the
    router's softmax (over all experts; ``renormalize``: over the chosen ones). Qwen2-MoE adds a
    shared expert every token goes through, gated by a sigmoid."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    layers: frozenset[int]  # the layers whose MLP is sparse (Qwen's mlp_only_layers keep a dense one)
    shared_intermediate_size: int = 0  # 0: no shared expert
    # GPT-OSS: (alpha, limit) of its experts' clamped SwiGLU (``kernels.reference.swiglu_oai``); its router and
    # experts then have biases, and gate|up come interleaved in the checkpoint (None: SiLU, no biases)
    swiglu: tuple[float, float] | None = None

    @classmethod
    def from_hf(cls, cfg: dict, model_type: str) -> MoEConfig:
        arch = SUPPORTED_ARCHITECTURES[model_type]
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        top_k = cfg.get("num_experts_per_tok")
        if not isinstance(experts, int) or not isinstance(top_k, int) or not 0 < top_k <= experts:
            raise ValueError(f"a mixture of experts needs num_experts and num_experts_per_tok (at most as many), "
                             f"got {experts!r} and {top_k!r}")
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or ())
        layers = frozenset(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
        width = cfg.get(arch.get("expert_width", "moe_intermediate_size"))
        if not isinstance(width, int) or width <= 0:
            raise ValueError(f"a mixture of experts needs its experts' width "
                             f"({arch.get('expert_width', 'moe_intermediate_size')}), got {width!r}")
        return cls(experts, top_k, intermediate_size=width,
                   renormalize=bool(arch.get("norm_topk_prob", cfg.get("norm_topk_prob", False))), layers=layers,
                   shared_intermediate_size=arch.get("shared_expert") and cfg.get("shared_expert_intermediate_size")
                   or 0,
                   swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))
                   if arch.get("gpt_oss") else None)


# a LLaVA vision tower's defaults where its config leaves them out (transformers' CLIPVisionConfig and
# SiglipVisionConfig; LlavaConfig's own, llava-1.5's CLIP ViT-L/14 at 336, where it names no tower at all)
_TOWERS = {"clip_vision_model": {"image_size": 224, "patch_size": 32},
           "siglip_vision_model": {"image_size": 224, "patch_size": 16}}
_LLAVA_TOWER = {"model_type": "clip_vision_model", "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14,
                "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16, "projection_dim": 768}


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA model's eyes (``engine/models/vision.py``): a CLIP or SigLIP vision tower whose hidden states
    at ``feature_layers`` (concatenated), past its class token unless ``keep_cls``, go through a two-layer
    projector into the language model's embeddings; each image stands for ``num_tokens`` copies of
    ``image_token_id`` in the prompt."""

    tower: dict  # the tower's config (its config.json keys, model_type among them)
    image_token_id: int
    feature_layers: tuple[int, ...]
    keep_cls: bool  # vision_feature_select_strategy "full" ("default": the first position is dropped)
    projector_act: str
    projector_bias: bool
    image_size: int  # pixels a side
    num_tokens: int

    @classmethod
    def from_hf(cls, cfg: dict) -> VisionConfig:
        tower = dict(cfg.get("vision_config") or _LLAVA_TOWER)
        kind = tower.setdefault("model_type", "clip_vision_model")
        if kind not in _TOWERS:
            raise ValueError(f"a LLaVA vision tower {kind!r} is not supported ({', '.join(_TOWERS)} are)")
        tower = _TOWERS[kind] | tower
        layers = cfg.get("vision_feature_layer", -2)
        layers = (layers,) if isinstance(layers, int) else tuple(layers)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full") or not layers or not all(isinstance(i, int) for i in layers):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} (default, full) or vision_feature_layer "
                             f"{cfg.get('vision_feature_layer')!r} (an index or a list of them) not supported")
        image, patch = tower["image_size"], tower["patch_size"]
        if image % patch:
            raise ValueError(f"a vision tower whose patches ({patch}) do not tile its images ({image})")
        positions = (image // patch) ** 2 + (kind == "clip_vision_model")  # (CLIP's class token first)
        return cls(tower, int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))), layers,
                   strategy == "full", cfg.get("projector_hidden_act", "gelu"),
                   bool(cfg.get("multimodal_projector_bias", True)), image,
                   positions - (strategy == "default"))


@dataclass(frozen=True)
class EncoderConfig:
    """What a BERT-style encoder adds to the shape: LayerNorms after each sublayer, absolute position
    embeddings (RoBERTa's past its padding id, skipping padding tokens) and token type embeddings; or
    ModernBERT's body (``modern``)."""

    type_vocab_size: int  # 2: BERT's pairs, the second text's tokens (after the first [SEP]) of type 1; 0: none
    layer_norm_eps: float
    hidden_act: str  # the intermediate layer's: gelu (erf), gelu_tanh, relu
    pad_token_id: int  # RoBERTa: positions count from pad_token_id + 1, padding tokens at pad_token_id
    roberta: bool  # RoBERTa, XLM-R, MPNet: their positions (and not BERT's token types)
    relative_buckets: int = 0  # MPNet: a bias on each score by the query's and key's distance (these buckets)
    # a classifier's head over the first token's state: "roberta" (RoBERTa's, MPNet's: dense, tanh, out_proj),
    # "bert" (pooler dense, tanh, classifier), "distilbert" (pre_classifier, ReLU, classifier)
    head: str = "bert"
    pooling: str = "cls"  # what a classifier's head reads: the first token's state (ModernBERT's may be "mean")
    modern: ModernBertSettings | None = None  # ModernBERT (``engine/models/modernbert.py``)


@dataclass(frozen=True)
class ModernBertSettings:
    """ModernBERT's: pre-norm layers, RoPE, a gated MLP, and layers whose keys are those within ``window`` positions
    of the query (the others see all), each kind with its own RoPE base; no biases unless the config says."""

    window: int  # local_attention // 2
    sliding: frozenset[int]
    rope_theta: float  # the full layers'
    local_rope_theta: float
    attention_bias: bool
    mlp_bias: bool
    norm_bias: bool
    classifier_bias: bool
    classifier_act: str


_ENCODER_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quant: QuantConfig | None = None  # an AWQ or GPTQ int4 checkpoint
    lm_head: bool = True  # False: a checkpoint without one (an embedding model's backbone): it cannot generate
    moe: MoEConfig | None = None  # a mixture of experts
    sliding_window: int | None = None  # below max_position_embeddings: attention sees that many tokens back...
    window_layers: frozenset[int] | None = None  # ...in these, the sliding layers (None: all of them)
    rotary_dim: int = 0  # RoPE turns each head's first rotary_dim dims (0: all head_dim of them)
    gemma: int = 0  # Gemma's generation (1, 2, 3; 0: not Gemma): see SUPPORTED_ARCHITECTURES
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_tanh
    attn_scale: float | None = None  # multiplies q.k (None: 1 / sqrt(head_dim); Gemma: query_pre_attn_scalar's)
    attn_softcap: float = 0.0  # Gemma 2: scores s -> cap tanh(s / cap) (0: none)
    final_softcap: float = 0.0  # Gemma 2: the same on the logits
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (no scaling); None: as the others
    olmo: bool = False  # OLMo 2, 3: see SUPPORTED_ARCHITECTURES
    # Granite: the embeddings times embedding_multiplier, each sublayer's output times residual_multiplier
    # before it joins the residual stream, the logits divided by logits_scaling (its scores: attn_scale)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    vision: VisionConfig | None = None  # LLaVA: images in the prompt (None: text only)
    # a sequence classifier's (``*ForSequenceClassification``: classifiers, reward models) labels, in their
    # ids' order: its ``score`` head turns the last token's state into one logit each; no lm_head
    labels: tuple[str, ...] = ()
    # vLLM's classifier_from_token (a reranker served as a classifier: Qwen3-Reranker): the score head is the
    # LM head's rows of these tokens; of two (["no", "yes"]), one label, the second's row less the first's
    score_tokens: tuple[str, ...] = ()
    encoder: EncoderConfig | None = None  # a BERT-style encoder (ENCODER_ARCHITECTURES): embeds, classifies
    gpt_oss: bool = False  # GPT-OSS: attention sinks, an o_proj bias, float32 norm weights (SUPPORTED_ARCHITECTURES)

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (else a dense one)."""
        return self.moe is not None and layer in self.moe.layers

    def sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` is a sliding one (Gemma 3's turn RoPE by their own base, window or not)."""
        return self.window_layers is None or layer in self.window_layers

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: it attends to every position)."""
        return self.sliding_window if self.sliding_window is not None and self.sliding(layer) else 0

    @classmethod
    def from_hf(cls, cfg: dict, eos_token_ids: list[int] | None = None) -> ModelConfig:
        if cfg.get("model_type") == "gemma3":
            cfg = _gemma3_text(cfg)
        vision = None
        if cfg.get("model_type") == "llava":
            vision = VisionConfig.from_hf(cfg)
            cfg = _language_config(cfg, {"model_type": "llama"})
        model_type = cfg.get("model_type", "")
        if model_type in ENCODER_ARCHITECTURES:
            return _encoder(cfg, model_type)
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = ", ".join(cfg.get("architectures") or [model_type or "unknown"])
            raise ValueError(
                f"unsupported architecture {archs} (model_type {model_type!r}); tokenmill supports "
                f"the Llama family and its mixtures of experts: {', '.join(SUPPORTED_ARCHITECTURES)}; "
                f"and encoders that embed and classify: {', '.join(ENCODER_ARCHITECTURES)}"
            )
        _check_numbers(cfg)
        arch = SUPPORTED_ARCHITECTURES[model_type]
        gemma = arch.get("gemma", 0)
        if gemma >= 2:
            cfg = (_GEMMA2_DEFAULTS if gemma == 2 else _GEMMA3_DEFAULTS) | cfg
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention (EmbeddingGemma) is not supported: tokenmill's attention is "
                             "causal")
        window, window_layers = _sliding_window(cfg, model_type)
        # transformers >= 5 nests RoPE settings in rope_parameters (Gemma 3: per kind of layer); older
        # configs keep them flat.
        rope = dict(cfg.get("rope_parameters") or {})
        local = None  # the sliding layers' own RoPE, where it differs: its base, unscaled
        if "full_attention" in rope:  # RoPE per kind of layer
            local = rope.get("sliding_attention")
            if local == rope["full_attention"]:
                local = None
            elif local and local.get("rope_type", "default") != "default":
                raise ValueError(f"the sliding layers' own RoPE scaling ({local['rope_type']}) is not supported")
            rope = dict(rope["full_attention"])
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        local_theta = None if local is None else float(local.get("rope_theta", rope_theta))
        if gemma == 3:
            local_theta = float(local_theta or cfg.get("rope_local_base_freq", 10_000.0))
        elif model_type == "olmo3" and cfg.get("rope_scaling"):  # (transformers: a flat scaling is the full
            local_theta = rope_theta  # layers' alone, the sliding ones turn unscaled)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # RoPE over the first rotary_dim of each head's dims only (Phi-4-mini: 0.75 of them)
        rotary_dim = round(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"RoPE over {rotary_dim} of a head's {head_dim} dims: it must be an even number of them")
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            kind = {"su": "longrope"}.get(kind, kind)  # (Phi-3-128k's first configs called it su)
            if kind not in ("llama3", "linear", "longrope", "yarn", "default"):
                raise ValueError(f"RoPE scaling {kind!r} is not supported (llama3, linear, longrope, yarn are)")
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
            if kind == "longrope":
                scaling = _longrope(scaling, cfg, rotary_dim)
            elif kind == "yarn":
                scaling = _yarn(scaling, cfg)
        quant = cfg.get("quantization_config")
        if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4":
            if not arch.get("gpt_oss"):
                raise ValueError(f"MXFP4 checkpoints are read for GPT-OSS's experts only, not {model_type}'s")
            quant = None  # GPT-OSS's experts, in MXFP4 blocks: kept so or widened at load (engine.loader)
        if arch.get("gpt_oss") and quant:
            raise ValueError("int4 (AWQ, GPTQ) checkpoints of GPT-OSS are not supported: load OpenAI's MXFP4 one, "
                             "its bf16 one, or a GGUF file")
        # as transformers reads it: Gemma 2 and 3 by hidden_activation alone; Gemma 1's "gelu" meant tanh's
        name = cfg.get("hidden_activation") if gemma >= 2 else cfg.get("hidden_act")
        name = name or ("gelu_pytorch_tanh" if gemma else "silu")
        act = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(
            "gelu_pytorch_tanh" if gemma == 1 and name == "gelu" else name)
        if act is None:
            raise ValueError(f"activation {name!r} is not supported (silu, gelu_pytorch_tanh are)")
        attn_scale = None  # what multiplies q.k: 1 / sqrt(head_dim), but for
        if gemma >= 2:
            attn_scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
        elif model_type == "granite":
            attn_scale = float(cfg.get("attention_multiplier", 1.0))
        eos = eos_token_ids if eos_token_ids is not None else cfg.get("eos_token_id")
        if eos is None:
            eos = []
        elif isinstance(eos, int):
            eos = [eos]
        if vision is not None and not 0 <= vision.image_token_id < cfg["vocab_size"]:
            raise ValueError(f"image_token_index {vision.image_token_id} is not in the language model's vocabulary")
        labels = _labels(cfg)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=_max_positions(cfg, scaling),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", bool(gemma))),
            attention_bias=bool(cfg.get("attention_bias", arch.get("attention_bias", False))),
            qk_norm=arch.get("qk_norm", False),
            eos_token_ids=tuple(int(e) for e in eos),
            bos_token_id=cfg.get("bos_token_id"),
            quant=QuantConfig.from_hf(quant) if quant else None,
            moe=MoEConfig.from_hf(cfg, model_type) if arch.get("moe") else None,
            sliding_window=window,
            window_layers=window_layers,
            rotary_dim=rotary_dim,
            gemma=gemma,
            hidden_act=act,
            attn_scale=attn_scale,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            local_rope_theta=local_theta,
            olmo=arch.get("olmo", False),
            gpt_oss=arch.get("gpt_oss", False),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
            vision=vision,
            labels=labels,
            lm_head=not labels,
            score_tokens=tuple(cfg["classifier_from_token"]) if labels and cfg.get("classifier_from_token") else (),
        )


_WHOLE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")
_REAL = ("rms_norm_eps", "rope_theta")


def _check_numbers(cfg: dict) -> None:
    """The shape's numbers are numbers (``"1024"`` failed far from config.json, a traceback: review)."""
    for key in (*_WHOLE, *_REAL):
        v = cfg.get(key)
        kinds = int if key in _WHOLE else (int, float)
        if v is not None and (isinstance(v, bool) or not isinstance(v, kinds)):
            raise ValueError(f"config.json's {key} is {v!r}: {'a whole number' if key in _WHOLE else 'a number'} "
                             "is wanted")


def _encoder(cfg: dict, model_type: str) -> ModelConfig:
    """A BERT, RoBERTa, XLM-R, MPNet or DistilBERT checkpoint's shape (transformers' defaults where config.json
    leaves a key out); ModernBERT's: ``_modernbert``."""
    if model_type == "distilbert":
        cfg = {_DISTILBERT_KEYS.get(k, k): v for k, v in cfg.items()} | {"type_vocab_size": 0, "layer_norm_eps": 1e-12}
    if model_type == "modernbert":
        return _modernbert(cfg)
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported (absolute is)")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError(f"a {model_type} decoder is not supported: encoders embed and classify")
    if "classifier_from_token" in cfg:
        raise ValueError("classifier_from_token reads a language model's head: an encoder has none")
    name = cfg.get("hidden_act", "gelu")
    if name not in _ENCODER_ACTS:
        raise ValueError(f"activation {name!r} is not supported in an encoder ({', '.join(_ENCODER_ACTS)} are)")
    roberta, mpnet = model_type not in ("bert", "distilbert"), model_type == "mpnet"
    pad = cfg.get("pad_token_id")
    pad = (1 if roberta else 0) if pad is None else pad
    hidden, heads = cfg.get("hidden_size", 768), cfg.get("num_attention_heads", 12)
    positions = cfg.get("max_position_embeddings", 512) - ((pad + 1) if roberta else 0)
    if hidden % heads or positions < 1:
        raise ValueError(f"{model_type}: {heads} heads do not divide hidden_size {hidden}, or no position is left "
                         f"({cfg.get('max_position_embeddings')} past padding id {pad})")
    labels = _labels(cfg)
    return ModelConfig(
        model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", 3072), num_layers=cfg.get("num_hidden_layers", 12),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, rms_norm_eps=0.0, rope_theta=0.0,
        rope_scaling=None, max_position_embeddings=positions, tie_word_embeddings=False, attention_bias=True,
        qk_norm=False, eos_token_ids=(), bos_token_id=None, lm_head=False, labels=labels,
        encoder=EncoderConfig(0 if mpnet else int(cfg.get("type_vocab_size", 2)),
                              float(cfg.get("layer_norm_eps", 1e-12)), _ENCODER_ACTS[name], pad, roberta,
                              int(cfg.get("relative_attention_num_buckets", 32)) if mpnet else 0,
                              "roberta" if roberta else model_type))


def _modernbert(cfg: dict) -> ModelConfig:
    """ModernBERT's shape (transformers' ModernBertConfig defaults where config.json leaves a key out): its layer
    kinds from ``layer_types``, else every ``global_attn_every_n_layers``-th a full one; RoPE bases from
    ``rope_parameters`` or the flat ``global_rope_theta``, ``local_rope_theta``."""
    n = cfg.get("num_hidden_layers", 22)
    types = cfg.get("layer_types") or ["full_attention" if i % cfg.get("global_attn_every_n_layers", 3) == 0
                                       else "sliding_attention" for i in range(n)]
    if set(types) - {"full_attention", "sliding_attention"} or len(types) != n:
        raise ValueError(f"ModernBERT's layer_types must name each of its {n} layers full_attention or "
                         f"sliding_attention, got {types!r}")
    rope = cfg.get("rope_parameters") or {}
    kinds = [cfg.get("rope_scaling") or {}, *(rope.get(k) or {} for k in ("full_attention", "sliding_attention"))]
    scaled = {k.get("rope_type", k.get("type", "default")) for k in kinds} - {"default"}
    if scaled:
        raise ValueError(f"ModernBERT with RoPE scaling {sorted(scaled)} is not supported")
    theta = float((rope.get("full_attention") or {}).get("rope_theta", cfg.get("global_rope_theta", 160_000.0)))
    local = float((rope.get("sliding_attention") or {}).get("rope_theta", cfg.get("local_rope_theta", 10_000.0)))
    names = {"hidden_activation": cfg.get("hidden_activation", "gelu"),
             "classifier_activation": cfg.get("classifier_activation", "gelu")}
    for key, name in names.items():
        if name not in _ENCODER_ACTS:
            raise ValueError(f"{key} {name!r} is not supported in an encoder ({', '.join(_ENCODER_ACTS)} are)")
    pooling = cfg.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"ModernBERT's classifier_pooling {pooling!r} is not supported (cls, mean are)")
    hidden, heads = cfg.get("hidden_size", 768), cfg.get("num_attention_heads", 12)
    if hidden % heads:
        raise ValueError(f"modernbert: {heads} heads do not divide hidden_size {hidden}")
    settings = ModernBertSettings(
        cfg.get("local_attention", 128) // 2, frozenset(i for i, t in enumerate(types) if t == "sliding_attention"),
        theta, local, bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False)),
        bool(cfg.get("norm_bias", False)), bool(cfg.get("classifier_bias", False)),
        _ENCODER_ACTS[names["classifier_activation"]])
    pad = cfg.get("pad_token_id")
    return ModelConfig(
        model_type="modernbert", vocab_size=cfg.get("vocab_size", 50368), hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", 1152), num_layers=n, num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, rms_norm_eps=0.0, rope_theta=theta, rope_scaling=None,
        max_position_embeddings=cfg.get("max_position_embeddings", 8192), tie_word_embeddings=False,
        attention_bias=settings.attention_bias, qk_norm=False, eos_token_ids=(), bos_token_id=None, lm_head=False,
        labels=_labels(cfg),
        encoder=EncoderConfig(0, float(cfg.get("norm_eps", 1e-5)), _ENCODER_ACTS[names["hidden_activation"]],
                              50283 if pad is None else pad, False, head="modernbert", pooling=pooling,
                              modern=settings))


def _labels(cfg: dict) -> tuple[str, ...]:
    """A ``*ForSequenceClassification`` checkpoint's labels, as transformers names them (``id2label``, else
    ``LABEL_i`` for ``num_labels``, 2 by default); () for any other."""
    tokens = cfg.get("classifier_from_token")
    if not any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or ()):
        if tokens is not None:
            raise ValueError("classifier_from_token needs the architecture of a classifier too (vLLM's): "
                             "--hf-overrides '{\"architectures\": [\"Qwen3ForSequenceClassification\"], ...}'")
        return ()
    if tokens is not None:
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens) \
                or len(set(tokens)) < len(tokens):
            raise ValueError(f"classifier_from_token must be a list of distinct tokens, got {tokens!r}")
        if cfg.get("final_logit_softcapping"):  # (capped logits' difference is no row's product)
            raise ValueError("classifier_from_token cannot serve a model whose logits are soft-capped (Gemma 2)")
        return ("LABEL_0",) if len(tokens) == 2 else tuple(tokens)
    given = cfg.get("id2label") or {}
    try:
        names = {int(i): str(v) for i, v in given.items()}
        n = len(names) or int(cfg.get("num_labels", 2))
    except (AttributeError, TypeError, ValueError):
        names, n = {}, 0
    if n < 1 or (names and sorted(names) != list(range(n))):
        raise ValueError(f"a sequence classifier needs labels 0..n-1 (id2label, or num_labels), got id2label "
                         f"{given!r}, num_labels {cfg.get('num_labels')!r}")
    return tuple(names.get(i, f"LABEL_{i}") for i in range(n))


def _gemma3_text(cfg: dict) -> dict:
    """Gemma 3 4B, 12B, 27B (Gemma3ForConditionalGeneration): the language model's config, which holds
    the text model's keys (the vision tower's weights are left unread)."""
    return _language_config(cfg, {}) | {"model_type": "gemma3_text"}


def _language_config(cfg: dict, defaults: dict) -> dict:
    """A multimodal model's language model config: its text_config (over ``defaults``), with the ids the top
    level keeps."""
    text = defaults | dict(cfg.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id", "quantization_config"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    return text


def _sliding_window(cfg: dict, model_type: str) -> tuple[int | None, frozenset[int] | None]:
    """The sliding window (None: none, or one no shorter than the positions) and the sliding layers (None:
    all): ``layer_types``, or transformers' rules where a config predates them (Gemma 2: even layers;
    Gemma 3: five of each six; Qwen2: those from max_window_layers on). The layers are named even where no
    window is left: Gemma 3's turn RoPE by their own base all the same."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        layers = frozenset(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
    elif model_type == "gemma2":
        layers = frozenset(range(0, n, 2))
    elif model_type == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", 6)
        layers = frozenset(i for i in range(n) if (i + 1) % pattern)
    elif model_type == "olmo3":
        layers = frozenset(i for i in range(n) if (i + 1) % 4)
    elif model_type == "qwen2":
        layers = frozenset(range(cfg.get("max_window_layers", 28), n))
    elif model_type == "qwen2_moe":  # (its own rule in transformers: even layers below max_window_layers)
        layers = frozenset(range(0, min(n, cfg.get("max_window_layers", 28)), 2))
    else:
        layers = None
    on = cfg.get("use_sliding_window", model_type in ("mistral", "mixtral", "phi3", "gemma2", "gemma3_text", "olmo3",
                                                      "gpt_oss"))
    window = cfg.get("sliding_window")
    if not on or not window or window >= cfg.get("max_position_embeddings", 0):
        return None, layers
    return int(window), layers


def _max_positions(cfg: dict, scaling: dict | None) -> int:
    """The positions the model is served to: config.json's, or YaRN's stretch of the original ones where
    that is longer (Qwen's long-context recipe adds YaRN and leaves max_position_embeddings as it was;
    vLLM serves the stretch too)."""
    n = cfg.get("max_position_embeddings", 4096)
    if scaling and scaling["rope_type"] == "yarn":
        n = max(n, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return n


def _yarn(scaling: dict, cfg: dict) -> dict:
    """YaRN's parameters as transformers reads them (``_compute_yarn_parameters``): the stretch ``factor``
    (else max_position_embeddings over the original positions), the ramp between ``beta_fast`` and
    ``beta_slow`` rotations (its ends rounded out unless ``truncate`` is false), and the factor cos and
    sin are scaled by (``attention_factor``, else 0.1 ln(factor) + 1, or DeepSeek's ratio of two such
    with ``mscale`` and ``mscale_all_dim``)."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise ValueError("YaRN needs original_max_position_embeddings (the positions the model was trained on)")
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale()
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
            "attention_factor": float(attention), "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1), "truncate": bool(scaling.get("truncate", True))}


def _longrope(scaling: dict, cfg: dict, rotary_dim: int) -> dict:
    """Phi-3's LongRoPE, as transformers reads it: per-frequency ``short_factor`` and ``long_factor``
    (for contexts past ``original_max_position_embeddings``), and the factor cos and sin are scaled by."""
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    factors = [scaling.get("short_factor"), scaling.get("long_factor")]
    if not original or any(not isinstance(f, list) or len(f) != rotary_dim // 2 for f in factors):
        raise ValueError(f"LongRoPE needs original_max_position_embeddings and short_factor, long_factor of "
                         f"{rotary_dim // 2} values each")
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(f) for f in factors[0]],
            "long_factor": [float(f) for f in factors[1]], "original_max_position_embeddings": int(original),
            "attention_factor": float(attention)}
