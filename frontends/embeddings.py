"""``POST /v1/embeddings``: OpenAI's embeddings API over the engine's pooling (``engine.pooling``).

``input``: a string, a list of strings, a list of token ids or a list of such lists (at most
``MAX_INPUTS``, OpenAI's limit, and no more than the engine's waiting queue holds); each is one
engine request, batched with whatever else runs (chats included: one server, one model, both APIs). ``encoding_format``: ``float`` (default) or ``base64``
(little-endian float32s: what the openai client asks for unless told otherwise, and decodes
itself). ``dimensions``: the first this many of each vector, normalized after the cut
(Matryoshka models: Qwen3-Embedding...). vLLM's ``normalize`` (default: the model's) and
``truncate_prompt_tokens`` (keep the last k tokens; -1: as many as the context holds) and this
server's ``priority``, ``timeout`` and ``cache_salt`` work as for completions. ``usage``
counts prompt tokens.
"""

from __future__ import annotations

import base64
import time

from engine.protocol import PoolingParams, SamplingParamError, SamplingParams, embedding_floats
from frontends import openai_params as op
from frontends.errors import ApiError
from frontends.generation import Generation

ENCODINGS = ("float", "base64")
MAX_INPUTS = 2048  # OpenAI's; LangChain's OpenAIEmbeddings sends 1000 at a time


def parse_pooling(data: dict) -> PoolingParams:
    try:
        return PoolingParams(op.field(data, "dimensions", int, None), op.field(data, "normalize", bool, None))
    except SamplingParamError as e:
        raise ApiError(400, str(e), param=e.param) from None


def truncate(prompts: list[list[int]], data: dict, max_model_len: int) -> list[list[int]]:
    """``truncate_prompt_tokens`` applied (the last k tokens kept); then every input must fit the context."""
    k = op.field(data, "truncate_prompt_tokens", int, None)
    if k is not None:
        if k == -1:
            k = max_model_len
        if not 1 <= k <= max_model_len:
            raise ApiError(400, f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got {k}",
                           param="truncate_prompt_tokens")
        prompts = [p[-k:] for p in prompts]
    for p in prompts:
        if len(p) > max_model_len:
            raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                           f"requested {len(p)} tokens in the input for embedding generation. Please reduce "
                           "the length of the input (or set truncate_prompt_tokens).", param="input")
    return prompts


class EmbeddingsFormat:
    """The response body, once every input's vector is in."""

    def __init__(self, model: str, api_id: str, gen: Generation, encoding: str) -> None:
        self.model, self.api_id, self.gen, self.encoding = model, api_id, gen, encoding
        self.created = int(time.time())

    def _vector(self, raw: bytes) -> str | list[float]:
        return base64.b64encode(raw).decode() if self.encoding == "base64" else embedding_floats(raw)

    def response(self) -> dict:
        n = self.gen.num_prompt_tokens
        return {"id": self.api_id, "object": "list", "created": self.created, "model": self.model,
                "data": [{"object": "embedding", "index": c.index, "embedding": self._vector(c.embedding)}
                         for c in self.gen.choices],
                "usage": {"prompt_tokens": n, "total_tokens": n}}


async def embeddings_job(api, data: dict, arrival: float | None = None) -> tuple[Generation, EmbeddingsFormat]:
    """A /v1/embeddings body checked and turned into an unstarted generation (``api``: the ``OpenAIApi``)."""
    op.check_model(data, api.model)
    encoding = op.field(data, "encoding_format", str, "float")
    if encoding not in ENCODINGS:
        raise ApiError(400, f"encoding_format must be one of {', '.join(ENCODINGS)}, got {encoding!r}",
                       param="encoding_format")
    pooling = parse_pooling(data)
    deadline, priority, cache_salt = op.parse_deadline(data), op.parse_priority(data), op.parse_cache_salt(data)
    limit = min(MAX_INPUTS, api.client.ready.max_num_waiting_requests)  # more could never be queued at once
    prompts = await op.parse_prompts(data, api._encode, api.codec.vocab_size, api.max_chars, "input", limit)
    prompts = truncate(prompts, data, api.max_model_len)
    api._require_engine()
    api_id = api._new_id("embd")
    gen = Generation(api.client, api.codec, api_id, prompts, 1, lambda i: SamplingParams(max_tokens=1), priority,
                     None, deadline, cache_salt, api.metrics, arrival)
    gen.pooling = pooling
    return gen, EmbeddingsFormat(api.model, api_id, gen, encoding)
