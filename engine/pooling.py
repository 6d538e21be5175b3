"""Embeddings: a request's prompt pooled into one vector instead of sampled from (``/v1/embeddings``).

Any loaded model embeds, next to its generations: an embedding request is a prompt the scheduler
fills like any other, whose hidden states (the model's last, after its final norm) are pooled
when its last prompt token is computed; it then ends, with its vector and no token.

The pooling is the model's (``PoolerConfig.of``): its sentence-transformers files say it where it
has them (``modules.json``, ``1_Pooling/config.json``: Qwen3-Embedding, gte-Qwen2...), a GGUF's
``<arch>.pooling_type`` where it is one, else the last token, L2-normalized (what vLLM and
sentence-transformers do with a decoder; an encoder's: the first token, ``cls``). ``--pooler-config``
overrides it (vLLM's flag).

- ``last``: the last prompt token's state. The rest of the prompt may come from the prefix cache
  (its last token is always computed).
- ``mean``: the mean over every prompt token's state. Such a request takes nothing from the
  prefix cache; each chunk's sum is added to its ``PoolState``, and a chunk that starts at 0 (the
  first, or a recompute after a preemption) starts it afresh.
- ``cls``: the first prompt token's state (an encoder's [CLS]; with a decoder, its BOS's). Nothing
  from the prefix cache either; the first chunk's state is kept, as a mean's sum, until the last.

An encoder's prompt (``whole``: ``engine/models/bert.py``) is computed in one step, none of it from
the prefix cache, whatever its pooling.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import POOLING_TYPES

# llama.cpp's LLAMA_POOLING_TYPE_* as GGUF stores them: 0 none, 1 mean, 2 cls, 3 last, 4 rank
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
# sentence-transformers' Pooling config: mode key -> ours (the others have no decoder use here)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
             "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "last"
    normalize: bool = True  # L2, unless a request says otherwise

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"the model's pooling {self.pooling_type!r} is not supported for embeddings "
                             f"({', '.join(POOLING_TYPES)} are; --pooler-config '{{\"pooling_type\": \"LAST\"}}' "
                             "picks one)")

    @classmethod
    def of(cls, model_path: str, override: dict | None = None, default: str = "last") -> PoolerConfig:
        """The model's pooling, with ``override`` (``--pooler-config``: ``pooling_type``, ``normalize``;
        checked by ``EngineConfig``) over it; ``default`` where neither says (an encoder's: ``cls``)."""
        found = _from_gguf(model_path) if model_path.endswith(".gguf") else _from_sentence_transformers(model_path)
        found |= override or {}
        return cls(str(found.get("pooling_type", default)).lower(), found.get("normalize", True))


def _from_sentence_transformers(path: str) -> dict:
    """What the model's sentence-transformers files say; a pooling type that is not one supported mode
    (or files that cannot be read) is refused by ``PoolerConfig`` unless ``--pooler-config`` names one."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return {}
    try:
        with open(modules_file) as f:
            types = {m["type"].rsplit(".", 1)[-1]: m for m in json.load(f)}
        found = {"normalize": "Normalize" in types}
        if "Pooling" in types:
            with open(os.path.join(path, types["Pooling"].get("path", ""), "config.json")) as f:
                settings = json.load(f)
            found["pooling_type"] = "+".join(ours for key, ours in _ST_MODES.items() if settings.get(key)) or "none"
        return found
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        return {"pooling_type": f"unreadable ({type(e).__name__}: {e})"}


def _from_gguf(path: str) -> dict:
    from engine.loader import gguf_field

    arch = gguf_field(path, "general.architecture")
    kind = gguf_field(path, f"{arch}.pooling_type")
    return {} if kind in (None, 0) else {"pooling_type": _GGUF_POOLING.get(kind, f"gguf pooling {kind}")}


class PoolState:
    """One embedding request's pooling: what the engine needs of it, and a mean's running sum."""

    __slots__ = ("pooling_type", "dimensions", "normalize", "whole", "sum")

    def __init__(self, pooling_type: str, dimensions: int | None, normalize: bool, whole: bool = False):
        self.pooling_type, self.dimensions, self.normalize = pooling_type, dimensions, normalize
        self.whole = whole  # an encoder's prompt: computed in one step, none of it from the prefix cache
        self.sum: torch.Tensor | None = None  # (hidden,) float32: a mean's prompt so far (a CLS's state)

    @property
    def uncached(self) -> bool:
        """Whether none of the prompt may come from the prefix cache (its states are all needed, or the first)."""
        return self.whole or self.pooling_type != "last"


def pool_rows(state: PoolState, row: int, start: int, n: int, final: bool) -> list[int]:
    """Rows of the flat batch to pool for a request whose chunk of ``n`` tokens from prompt position
    ``start`` is at ``row``."""
    if state.pooling_type == "mean":
        return list(range(row, row + n))
    if state.pooling_type == "cls":
        return [row] if start == 0 else []
    return [row + n - 1] if final else []


def pool(spans: list[tuple[PoolState, int, int, bool]], sums: torch.Tensor,
         head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor | None]:
    """After a step: ``sums[k]`` is span k's pooled rows summed; a span is (state, its chunk's first
    position, the prompt's length, whether the chunk ends the prompt). Per span: its vector (float32,
    on the device) when the prompt is done, else None (a mean's sum kept). ``head``: what turns a pooled
    state into the vector (a classifier's scores)."""
    out: list[torch.Tensor | None] = []
    for k, (state, start, length, final) in enumerate(spans):
        v = sums[k]
        if state.pooling_type != "last":  # (a CLS's later chunks add nothing: they pool no row)
            v = v if start == 0 or state.sum is None else state.sum + v
            state.sum = None if final else v
            if not final:  # (only a mean or a CLS pools a chunk that does not end the prompt)
                out.append(None)
                continue
            if state.pooling_type == "mean":
                v = v / length
        if head is not None:
            v = head(v)
        if state.dimensions is not None:
            v = v[:state.dimensions]
        out.append(F.normalize(v, dim=0) if state.normalize else v)
    return out


def to_bytes(vectors: list[torch.Tensor]) -> list[bytes]:
    """Vectors as the wire carries them, little-endian float32s (one copy to the host for all)."""
    if not vectors:
        return []
    flat = torch.cat(vectors).cpu().numpy().astype("<f4")
    out, start = [], 0
    for v in vectors:
        out.append(flat[start:start + len(v)].tobytes())
        start += len(v)
    return out
