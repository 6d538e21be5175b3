"""Random-weight model folders in the shapes of real models, so that a machine without network or model
hub can load, run and benchmark them: a transformers config (SmolLM2-135M's or 1.7B's, Qwen2-0.5B's, Qwen3-0.6B's or
Gemma-3-270M's, a scaled-down Qwen3-30B-A3B's or gpt-oss-20b's, the encoder bge-small-en-v1.5's, or any size), safetensors weights as transformers initialises them, and a byte-level BPE tokenizer over the
whole vocabulary (ids 0, 1, 2 are unk, bos and eos), so that no tokenizer is downloaded either.

    python3 tools/random_model.py smollm2-135m /tmp/smollm2 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os

import torch

# Architecture and config of each shape (bos/eos are the synthetic tokenizer's ids).
SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True)),
    # SmolLM2-1.7B: rows of whole 256-weight super-blocks, so a GGUF's K-quants (Q4_K_M) stay packed on the CPU
    "smollm2-1.7b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
                                   max_position_embeddings=8192, rope_theta=130000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True)),
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True)),
    # Qwen3-30B-A3B scaled down to run on a CPU (48 layers -> 6, hidden 2048 -> 1024, 128 experts -> 64,
    # each 768 -> 384 wide), its 8 experts a token and its router, renormalized, kept
    "qwen3-moe-tiny": ("qwen3_moe", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=6,
                                         num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                         num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384,
                                         norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
                                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # gpt-oss-20b scaled down to run on a CPU (24 layers -> 6, hidden 2880 -> 1440, 64 heads -> 32, experts 2880 ->
    # 704 wide: whole MXFP4 blocks), its 32 experts, 4 a token, window of 128 over every other layer, sinks, YaRN and
    # vocabulary kept
    "gpt-oss-tiny": ("gpt_oss", dict(hidden_size=1440, intermediate_size=704, num_hidden_layers=6,
                                     num_attention_heads=32, num_key_value_heads=4, head_dim=64, num_local_experts=32,
                                     num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                                     max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # Gemma 3 270M: a sliding window of 512 in five layers of each six, GELU, 256-wide heads, a 262k vocabulary
    "gemma3-270m": ("gemma3_text", dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
                                        query_pre_attn_scalar=256, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True)),
    # bge-small-en-v1.5: a BERT encoder (embeddings only; its tokenizer here adds no [CLS] and [SEP])
    "bge-small": ("bert", dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=12,
                               vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)),
}
UNK, BOS, EOS = 0, 1, 2
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def save_tokenizer(out_dir: str, vocab_size: int) -> None:
    """Byte-level BPE, GPT-2 style as SmolLM2's and Qwen2's are (so transformers' Qwen2Tokenizer, which
    rebuilds a byte-level BPE from the vocabulary and merges, reads it too): after the specials, the 256
    byte symbols, then merges of a token and a byte until the vocabulary is full. Any id decodes, any
    text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens, merges = ["<unk>", "<s>", "</s>", *byte_symbols], []
    for i in range(vocab_size - len(tokens)):
        pair = (tokens[3 + i // 256], byte_symbols[i % 256])
        merges.append(pair)
        tokens.append("".join(pair))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)


def build(out_dir: str, arch: str = "llama", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          **config) -> str:
    """Save a random ``arch`` ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss", "bert") model with these config values in
    ``out_dir``. ``initializer_range`` (transformers' 0.02 by default) is the weights' standard deviation."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    cfg_cls = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                                     "qwen3_moe": "Qwen3MoeConfig", "gemma3_text": "Gemma3TextConfig",
                                     "gpt_oss": "GptOssConfig", "bert": "BertConfig"}[arch])
    torch.manual_seed(seed)
    cfg = cfg_cls(bos_token_id=BOS, eos_token_id=EOS, **config)
    model = (AutoModel if arch == "bert" else AutoModelForCausalLM).from_config(cfg, dtype=dtype)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, config["vocab_size"])
    return out_dir


def build_shape(name: str, out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    arch, config = SHAPES[name]
    return build(out_dir, arch, dtype, seed, **config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    print(build_shape(args.shape, args.out_dir, getattr(torch, args.dtype), args.seed))


if __name__ == "__main__":
    main()
