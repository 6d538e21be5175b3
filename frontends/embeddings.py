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
import math
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
                           f"requested {len(p)} tokens in the input. Please reduce "
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


async def embeddings_job(api, data: dict, arrival: float | None = None, id_prefix: str = "embd",
                         pooling: PoolingParams | None = None) -> tuple[Generation, EmbeddingsFormat]:
    """A /v1/embeddings body checked and turned into an unstarted generation (``api``: the ``OpenAIApi``;
    ``frontends.scoring`` runs its rerank and score calls through it too, ``classify_job`` its scores with
    their ``pooling``: none of the request's)."""
    lora = op.check_model(data, api.model_names, api.adapters)
    if api.client.ready.labels and pooling is None:
        raise ApiError(400, f"{api.model} is a sequence classifier: it does not embed (POST /classify)", param="model")
    encoding = op.field(data, "encoding_format", str, "float")
    if encoding not in ENCODINGS:
        raise ApiError(400, f"encoding_format must be one of {', '.join(ENCODINGS)}, got {encoding!r}",
                       param="encoding_format")
    pooling = pooling or parse_pooling(data)
    deadline, priority = op.parse_deadline(data, api.request_timeout), op.parse_priority(data)
    cache_salt = op.parse_cache_salt(data)
    prompts = await op.parse_truncated_prompts(data, api._encode, api.codec, api.max_chars, api.max_model_len,
                                               "input", MAX_INPUTS)
    check_lengths(prompts, api.max_model_len)
    api._require_engine()
    api_id = api._new_id(id_prefix)
    gen = Generation(api.client, api.codec, api_id, prompts, 1, lambda i: SamplingParams(max_tokens=1), priority,
                     None, deadline, cache_salt, api.metrics, arrival)
    gen.pooling, gen.lora = pooling, lora
    return gen, EmbeddingsFormat(lora or api.model, gen, encoding)


def class_probs(scores: list[float]) -> list[float]:
    """A classifier's scores as probabilities: the softmax over its labels, a single label's sigmoid (vLLM's)."""
    if len(scores) == 1:
        return [1.0 / (1.0 + math.exp(-scores[0])) if scores[0] > -700 else 0.0]
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


class ClassifyFormat:
    """vLLM's ``/classify`` body: per input its label, each label's probability (softmax over the labels; one
    label's sigmoid) or, with ``"activation": false``, the raw scores, and ``num_classes``."""

    def __init__(self, model: str, gen: Generation, labels: list[str], activation: bool) -> None:
        self.model, self.gen, self.labels, self.activation = model, gen, labels, activation
        self.created = int(time.time())

    def body(self) -> bytes:
        data = []
        for c in self.gen.choices:
            scores = embedding_floats(c.embedding)
            probs = class_probs(scores) if self.activation else scores
            best = max(range(len(scores)), key=scores.__getitem__)
            data.append({"index": c.index, "label": self.labels[best], "probs": probs, "num_classes": len(probs)})
        n = self.gen.num_prompt_tokens
        return orjson.dumps({"id": self.gen.api_id, "object": "list", "created": self.created, "model": self.model,
                             "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})


async def classify_job(api, data: dict, arrival: float | None = None) -> tuple[Generation, ClassifyFormat]:
    """A /classify body (vLLM's: ``input`` as embeddings take it, ``truncate_prompt_tokens``, ``activation``)
    run as embeddings of the classifier's raw scores."""
    labels = api.client.ready.labels
    if not labels:
        raise ApiError(400, f"{api.model} does not classify: it has no sequence-classification head (a "
                       "*ForSequenceClassification checkpoint classifies)", param="model")
    activation = op.field(data, "activation", bool, True)
    gen, _ = await embeddings_job(api, data, arrival, id_prefix="classify", pooling=PoolingParams(None, False))
    return gen, ClassifyFormat(gen.lora or api.model, gen, labels, activation)
