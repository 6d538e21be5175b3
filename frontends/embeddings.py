"""``POST /v1/embeddings``: OpenAI's embeddings API over the engine's pooling (``engine.pooling``).

``input``: a string, a list of strings, a list of token ids or a list of such lists (at most
``MAX_INPUTS``, OpenAI's limit); each is one engine request, batched with whatever else runs
(chats included: one server, one model, both APIs), sent a window at a time (twice the engine's
``max_num_seqs``): a call of a thousand inputs does not queue them all ahead of the next chat.
``encoding_format``: ``float`` (default) or ``base64`` (little-endian float32s: what the openai
client asks for unless told otherwise, and decodes itself). ``dimensions``: the first this many of each vector, normalized after the cut
(Matryoshka models: Qwen3-Embedding...). vLLM's ``normalize`` (default: the model's) and
``truncate_prompt_tokens`` (keep the last k tokens; -1: as many as the context holds) and this
server's ``priority``, ``timeout`` and ``cache_salt`` work as for completions. ``usage``
counts prompt tokens.
"""

from __future__ import annotations

import base64
import time

import orjson

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


def check_lengths(prompts: list[list[int]], max_model_len: int) -> None:
    for p in prompts:
        if len(p) > max_model_len:
            raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                           f"requested {len(p)} tokens in the input for embedding generation. Please reduce "
                           "the length of the input (or set truncate_prompt_tokens).", param="input")


class EmbeddingsFormat:
    """The response body, once every input's vector is in."""

    def __init__(self, model: str, gen: Generation, encoding: str) -> None:
        self.model, self.gen, self.encoding = model, gen, encoding
        self.created = int(time.time())

    def _vector(self, raw: bytes) -> str | list[float]:
        return base64.b64encode(raw).decode() if self.encoding == "base64" else embedding_floats(raw)

    def body(self) -> bytes:
        """The response's JSON, written a vector at a time: on a thread (``openai_api``), the event loop
        gets the GIL back between two vectors, not after all of them."""
        n = self.gen.num_prompt_tokens
        head = orjson.dumps({"id": self.gen.api_id, "object": "list", "created": self.created, "model": self.model,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})
        parts = [head[:-1], b',"data":[']
        for c in self.gen.choices:
            parts += (orjson.dumps({"object": "embedding", "index": c.index, "embedding": self._vector(c.embedding)}),
                      b",")
        parts[-1] = b"]}"  # (the last comma; there is always at least one input)
        return b"".join(parts)  # one copy of the whole


async def embeddings_job(api, data: dict, arrival: float | None = None,
                         id_prefix: str = "embd") -> tuple[Generation, EmbeddingsFormat]:
    """A /v1/embeddings body checked and turned into an unstarted generation (``api``: the ``OpenAIApi``;
    ``frontends.scoring`` runs its rerank and score calls through it too)."""
    lora = op.check_model(data, api.model_names, api.adapters)
    encoding = op.field(data, "encoding_format", str, "float")
    if encoding not in ENCODINGS:
        raise ApiError(400, f"encoding_format must be one of {', '.join(ENCODINGS)}, got {encoding!r}",
                       param="encoding_format")
    pooling = parse_pooling(data)
    deadline, priority, cache_salt = op.parse_deadline(data), op.parse_priority(data), op.parse_cache_salt(data)
    prompts = await op.parse_truncated_prompts(data, api._encode, api.codec, api.max_chars, api.max_model_len,
                                               "input", MAX_INPUTS)
    check_lengths(prompts, api.max_model_len)
    api._require_engine()
    api_id = api._new_id(id_prefix)
    gen = Generation(api.client, api.codec, api_id, prompts, 1, lambda i: SamplingParams(max_tokens=1), priority,
                     None, deadline, cache_salt, api.metrics, arrival)
    gen.pooling, gen.lora = pooling, lora
    return gen, EmbeddingsFormat(lora or api.model, gen, encoding)
