"""Shared fixtures: tiny random-weight models made in the test, and the default model;
and, on machines without a GPU, Triton's interpreter switched on for the Triton kernel tests.

The tiny models borrow SmolLM2's real tokenizer (vocab 49152, chat template) so
that text round-trips and chat templates work end to end.
"""

from __future__ import annotations

import os
import shutil

import pytest

# Under pytest-xdist (`make test` runs WORKERS of them) each worker, and each server it starts, gets its share of
# the cores: torch's and OpenMP's default, all of them in each process, made two workers slower than one.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # (the cores this process may run on: its affinity, on Linux)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# Triton kernels run on CPU tensors only through Triton's interpreter, which triton
# decides when it is imported; so decide before anything imports it. Only where
# no NVIDIA driver is: with a GPU the Triton tests run compiled, on CUDA tensors.
# Nothing else runs Triton on the CPU, so no other test notices.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.model_path import default_model_path

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    vocab_size=49152,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's tokenizer; where the default model is not installed (a GPU machine it cannot be carried
    to), a random one of its vocabulary's size, for the tests that give token ids (tools/gpu_check.sh)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm_tokenizer")
    try:
        gguf = default_model_path()
    except FileNotFoundError:
        from tools.random_model import save_tokenizer

        save_tokenizer(str(out), TINY["vocab_size"])
        return str(out)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.save_pretrained(out)
    return str(out)


def make_tiny_model(out_dir: str, arch: str, tokenizer_dir: str | None, seed: int = 0, **overrides) -> str:
    """Save a random-weight ``arch`` ("llama", "qwen2", "qwen3", "mistral", "phi3"; mixtures of experts "mixtral",
    "qwen2_moe", "qwen3_moe", of 8 experts, 2 per token; "gemma", "gemma2", "gemma3_text": 4 layers, a sliding
    window of 16 in Gemma 2's every other layer and three of Gemma 3's four, Gemma 2's caps; "granite", with
    Granite 3 8B's scales; "olmo2", "olmo3"; "gpt_oss": 4 layers, a window of 16 over every other one, 8 experts,
    2 per token, random sinks and biases, its experts' SwiGLU clamped at 0.5 so that the clamps bite) model folder
    (fp32)."""

    import torch
    import transformers

    cfg_cls = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                                     "mistral": "MistralConfig", "mixtral": "MixtralConfig",
                                     "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
                                     "phi3": "Phi3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
                                     "gemma3_text": "Gemma3TextConfig", "granite": "GraniteConfig",
                                     "olmo2": "Olmo2Config", "olmo3": "Olmo3Config", "gpt_oss": "GptOssConfig"}[arch])
    kw = dict(TINY)
    if arch.startswith("gemma"):
        kw.update(num_hidden_layers=4, head_dim=16, tie_word_embeddings=True)
    if arch in ("gemma2", "gemma3_text"):
        kw.update(query_pre_attn_scalar=24, sliding_window=16, sliding_window_pattern=4)
    if arch == "gemma2":
        kw.update(attn_logit_softcapping=4.0, final_logit_softcapping=8.0)
    if arch == "granite":  # Granite 3 8B's scales (12, 0.22, 16), but scores' that tell (its 1/128 here: uniform)
        kw.update(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5, logits_scaling=16.0)
    if arch in ("mistral", "mixtral"):
        kw["sliding_window"] = None
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):
        kw.update(num_local_experts=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                  decoder_sparse_step=1, mlp_only_layers=[])
        if arch == "qwen2_moe":
            kw["shared_expert_intermediate_size"] = 96
        if arch == "qwen3_moe":
            kw["norm_topk_prob"] = True  # as Qwen3's MoE checkpoints set it (transformers' default is False)
    if arch == "gpt_oss":  # (its YaRN stretches 4096 positions 32 times: served here to max_model_len)
        kw.update(num_hidden_layers=4, head_dim=16, sliding_window=16, num_local_experts=8, num_experts_per_tok=2,
                  intermediate_size=48, swiglu_limit=0.5)
    kw.update(overrides)
    config = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _save_random(model, out_dir, tokenizer_dir, gemma=arch.startswith("gemma"), biases=arch == "gpt_oss")
    return out_dir


def make_tiny_mxfp4_gpt_oss(out_dir: str, tokenizer_dir: str | None) -> str:
    """A tiny GPT-OSS as OpenAI ships it: its experts in MXFP4 (``*_blocks``, ``*_scales``: random nibbles, every
    FP4 value, and scales 2^-6..2^-3; config quant_method mxfp4)."""
    import torch
    from safetensors.torch import load_file, save_file

    from tools.quantize_model import MXFP4_CONFIG, write_quantization_config

    path = make_tiny_model(out_dir, "gpt_oss", tokenizer_dir, seed=2, intermediate_size=64)
    file = os.path.join(path, "model.safetensors")
    tensors, g = load_file(file), torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # (E, K, N): x W
        tensors[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(121, 125, (e, n, k // 32), generator=g, dtype=torch.uint8)
    save_file(tensors, file)
    write_quantization_config(path, MXFP4_CONFIG)
    return path


def _save_random(model, out_dir: str, tokenizer_dir: str | None, gemma: bool, biases: bool = False) -> None:
    """Save ``model`` with its random init scaled up (tiny, it leaves logits all ties) and its norms not all
    ones, the tokenizer of ``tokenizer_dir`` beside it; ``biases``: every bias and sink random too (GPT-OSS)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif biases and name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif biases and "bias" in name:
                p.normal_(0.0, 0.1)
            elif "q_norm" in name or "k_norm" in name:  # Qwen3's per-head norms: not all ones
                p.uniform_(0.5, 1.5)
            elif "norm" in name and gemma:  # Gemma's (1 + w): not all ones either
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)


def make_tiny_gemma3_multimodal(out_dir: str, tokenizer_dir: str | None, seed: int = 7) -> str:
    """A random Gemma3ForConditionalGeneration folder (fp32) as Google ships Gemma 3 4B+: weights under
    language_model.model.* beside a (tiny) vision tower, and a text_config as sparse as theirs, so heads,
    head_dim (8, 4, 256), query_pre_attn_scalar and the RoPE bases are transformers' defaults. A sliding
    window of 16 in three of its four layers."""
    import json

    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, sliding_window=16,
                sliding_window_pattern=4, max_position_embeddings=1024)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=49151,
                       boi_token_index=49149, eoi_token_index=49150)
    torch.manual_seed(seed)
    _save_random(Gemma3ForConditionalGeneration(cfg), out_dir, tokenizer_dir, gemma=True)
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config["text_config"] = {k: v for k, v in config["text_config"].items() if k in text or k == "model_type"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), "llama", smollm_tokenizer_dir)


TINY_KEY = "sk-tiny"


def http_call(port: int, path: str, body: dict | None = None, key: str | None = None):
    """One request to 127.0.0.1:``port`` over raw HTTP: POST of ``body`` as JSON (GET without one), a bearer
    ``key`` if given; (status, body bytes, headers: read case-insensitively)."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request("POST" if body is not None else "GET", path, json.dumps(body) if body is not None else None,
                     headers)
        r = conn.getresponse()
        return r.status, r.read(), r.headers
    finally:
        conn.close()


@pytest.fixture(scope="session")
def tiny_server(tiny_llama):
    """``tokenmill serve`` on the tiny llama: float32, a 256-token context, served as "tiny", key ``TINY_KEY``; one
    for the session (its users leave it as they found it)."""
    from tests.test_server_e2e import Server

    s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--dtype", "float32", "--api-key", TINY_KEY,
               "--max-model-len", "256", startup=120)
    yield s
    s.close()


@pytest.fixture(scope="session")
def tiny_client(tiny_server):
    """The official openai client of ``tiny_server``."""
    import openai

    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=TINY_KEY, max_retries=0)


@pytest.fixture(scope="session")
def lora_tiny(tmp_path_factory, smollm_tokenizer_dir) -> tuple[str, str, str]:
    """A tiny llama and two LoRA adapters for it (``tools.random_lora``): rank 8 on all seven projections, and
    rank 4 on q and v."""
    from tools.random_lora import make_lora

    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(str(root / "model"), "llama", smollm_tokenizer_dir, seed=4)
    return model, make_lora(model, str(root / "a"), seed=1), make_lora(model, str(root / "b"), seed=2, r=4,
                                                                       modules=("q_proj", "v_proj"))


# llava-hf's chat template (llava-1.5): each message's images first, then its text, from content parts
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def make_tiny_llava(out_dir: str, tokenizer_dir: str, seed: int = 5, template: str | None = LLAVA_TEMPLATE,
                    **vision) -> str:
    """A random LlavaForConditionalGeneration folder (fp32) as llava-hf ships llava-1.5: a Llama under a CLIP
    tower (images of 30 pixels in patches of 6: 25 tokens each, the class token dropped), SmolLM2's tokenizer
    with ``<image>`` added (id 49152), a CLIP image processor, llava-hf's chat template (``template``; None:
    SmolLM2's, which reads contents as strings)."""
    import json

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    text = LlamaConfig(**(TINY | {"vocab_size": 49153}))
    tower = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, image_size=30, patch_size=6) | vision
    cfg = LlavaConfig(text_config=text.to_dict(), vision_config=tower, image_token_index=49152,
                      image_seq_length=25)
    torch.manual_seed(seed)
    _save_random(LlavaForConditionalGeneration(cfg), out_dir, None, gemma=False)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out_dir)
    size = tower["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(
        out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        assert json.load(f)["model_type"] == "llava"
    return out_dir


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava")), smollm_tokenizer_dir)
