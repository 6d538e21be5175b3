"""``POST /v1/rerank`` (also ``/rerank``, ``/v2/rerank``) and ``POST /v1/score`` (also ``/score``), as
vLLM serves them for an embedding model: relevance is the cosine similarity of the texts' embeddings
(``frontends.embeddings``; normalized, so a dot product), in [-1, 1].

Rerank (Jina's and Cohere's API, which RAG stacks point at a reranker): ``query``, ``documents``
(strings, or ``{"text": ...}``), ``top_n`` (0 or absent: all), ``return_documents`` (default true)
-> ``results`` best first, each ``{"index", "relevance_score", "document": {"text"}}``.

Score: ``text_1`` and ``text_2``, each a string or a list: one against each of the other's, or
pair by pair when both are lists of one length -> ``data``, ``{"index", "object": "score", "score"}``
in pair order.

Both take the embeddings' ``truncate_prompt_tokens``, ``priority``, ``timeout`` and ``cache_salt``;
``usage`` counts every text's tokens.

A one-label sequence classifier is a cross-encoder (a reranker that reads query and document together:
a ``*ForSequenceClassification`` reranker, or Qwen3-Reranker served with vLLM's ``classifier_from_token``):
each pair is one prompt, the two texts as its tokenizer pairs them, and its relevance the sigmoid of
the classifier's score, in [0, 1], as vLLM scores them. ``usage`` then counts the pairs' tokens.
"""

from __future__ import annotations

import operator
import time

import orjson

from engine.protocol import PoolingParams, embedding_floats
from frontends import openai_params as op
from frontends.embeddings import MAX_INPUTS, class_probs, embeddings_job
from frontends.errors import ApiError
from frontends.generation import Generation

_PASSED = ("model", "truncate_prompt_tokens", "priority", "timeout", "cache_salt")
_PAIRS_CHARS = 1 << 20  # characters of pairs tokenized in one piece of work (the tokenizer thread holds 4 MiB)


def _text(x, param: str) -> str:
    if isinstance(x, dict) and "text" in x:  # Jina's {"text": ...} (other keys, a title say, are not read)
        x = x["text"]
    if not isinstance(x, str) or not x:
        raise ApiError(400, f"'{param}' must hold non-empty strings (or {{\"text\": ...}} objects)", param=param)
    return x


def _texts(data: dict, param: str, one_or_many: bool) -> list[str]:
    value = data.get(param)
    if value is None:
        raise ApiError(400, f"Missing required field: '{param}'", param=param)
    if param == "documents" or (one_or_many and isinstance(value, list)):
        if not isinstance(value, list) or not value:
            raise ApiError(400, f"'{param}' must be a non-empty list", param=param)
        return [_text(x, param) for x in value]
    return [_text(value, param)]


def _dot(a: list[float], b: list[float]) -> float:
    """The cosine of two normalized embeddings (within [-1, 1]: their float32 rounding may pass 1 by 1e-7)."""
    return min(1.0, max(-1.0, sum(map(operator.mul, a, b))))


async def _embedded(api, data: dict, groups: list[tuple[str, list[str]]], arrival: float | None,
                    prefix: str) -> Generation:
    """The generation that embeds every group's texts (normalized), in order. A refusal of a text
    ("input" to the embeddings) is named by its group's field (found again, on that path only)."""
    texts = [t for _, group in groups for t in group]
    if len(texts) > MAX_INPUTS:
        raise ApiError(400, f"{' and '.join(name for name, _ in groups)} may hold at most {MAX_INPUTS} texts "
                       f"together, got {len(texts)}", param=groups[-1][0])
    passed = {k: data[k] for k in _PASSED if k in data} | {"normalize": True}
    try:
        gen, _ = await embeddings_job(api, passed | {"input": texts}, arrival, prefix)
    except ApiError as e:
        if e.param != "input":
            raise
        for name, group in groups:  # which field holds the text refused
            try:
                await embeddings_job(api, passed | {"input": group}, arrival, prefix)
            except ApiError as mine:
                if mine.param == "input":
                    mine.param, mine.message = name, _renamed(mine.message, name)
                    raise mine from None
        raise
    return gen


async def _cross_encoded(api, data: dict, pairs: list[tuple[str, str]], arrival: float | None,
                         prefix: str) -> Generation:
    """The generation that scores each (first, second) pair with the one-label classifier, in order. A pair too
    long is named by the field of the longer text of the longest pair."""
    first, second = ("query", "documents") if prefix == "rerank" else ("text_1", "text_2")
    if len(pairs) > MAX_INPUTS:
        raise ApiError(400, f"at most {MAX_INPUTS} pairs, got {len(pairs)}", param=second)
    longest = max(pairs, key=lambda p: len(p[0]) + len(p[1]))
    param = first if len(longest[0]) > len(longest[1]) else second
    keep = op.parse_truncation(data, api.max_model_len)
    if keep is None:  # (too long to fit, before any tokenizing)
        for a, b in pairs:
            op.check_text_length(len(a) + len(b), api.max_chars, param)
    # (truncated pairs are tokenized whole: which text is the longer decides the cut; the body bounds them)
    ids = []
    for piece, size in _pieces(pairs, _PAIRS_CHARS):  # (the tokenizer thread's work, never more than it holds)
        try:
            ids += await api._offload(min(size, _PAIRS_CHARS),
                                      lambda piece=piece: [api.codec.encode_pair(a, b, keep) for a, b in piece])
        except ValueError as e:  # (a cut that leaves no room for the texts: truncated_pair)
            raise ApiError(400, str(e), param="truncate_prompt_tokens") from None
    passed = {k: data[k] for k in _PASSED if k in data and k != "truncate_prompt_tokens"}
    try:
        gen, _ = await embeddings_job(api, passed | {"input": ids}, arrival, prefix,
                                      pooling=PoolingParams(None, False))
    except ApiError as e:
        if e.param == "input":  # (a pair longer than the context)
            e.param, e.message = param, _renamed(e.message, param)
        raise
    return gen


def _pieces(pairs: list[tuple[str, str]], limit: int):
    """``pairs`` in consecutive runs of at most ``limit`` characters (a longer pair alone), with their sizes."""
    piece, size = [], 0
    for a, b in pairs:
        if piece and size + len(a) + len(b) > limit:
            yield piece, size
            piece, size = [], 0
        piece.append((a, b))
        size += len(a) + len(b)
    if piece:
        yield piece, size


def _cross_encoder(api) -> bool:
    """Whether the model scores pairs itself (a one-label classifier); a classifier of more labels scores none."""
    labels = api.client.ready.labels
    if len(labels) > 1:
        raise ApiError(400, f"{api.model} classifies into {len(labels)} labels: it neither embeds nor scores pairs "
                       "(POST /classify)", param="model")
    return bool(labels)


def _relevance(choice) -> float:
    """A cross-encoder's relevance of one pair: the sigmoid of its score."""
    return class_probs(embedding_floats(choice.embedding))[0]


def _renamed(message: str, name: str) -> str:
    """An embeddings refusal's words, for the field ``name``."""
    return message.replace("'input'", f"'{name}'").replace("The input", f"The {name}").replace("the input", f"the {name}")


class RerankFormat:
    def __init__(self, model: str, gen: Generation, documents: list[str], top_n: int, with_documents: bool,
                 cross: bool = False):
        """``cross``: the choices are the (query, document) pairs' scores, not the texts' embeddings."""
        self.model, self.gen, self.documents = model, gen, documents
        self.top_n, self.with_documents, self.cross = top_n, with_documents, cross

    def _scores(self) -> list[float]:
        if self.cross:
            return [_relevance(c) for c in self.gen.choices]
        query, *docs = (embedding_floats(c.embedding) for c in self.gen.choices)
        return [_dot(query, d) for d in docs]

    def body(self) -> bytes:
        ranked = sorted(((s, i) for i, s in enumerate(self._scores())), key=lambda s: -s[0])
        results = []
        for score, i in ranked[:self.top_n or None]:
            result = {"index": i, "relevance_score": score}
            if self.with_documents:
                result["document"] = {"text": self.documents[i]}
            results.append(result)
        n = self.gen.num_prompt_tokens
        return orjson.dumps({"id": self.gen.api_id, "model": self.model, "results": results,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})


class ScoreFormat:
    def __init__(self, model: str, gen: Generation, pairs: list[tuple[int, int]], cross: bool = False):
        """``cross``: choice k is pair k's score (else the texts' embeddings, ``pairs`` indexing them)."""
        self.model, self.gen, self.pairs, self.cross = model, gen, pairs, cross
        self.created = int(time.time())

    def _scores(self) -> list[float]:
        if self.cross:
            return [_relevance(c) for c in self.gen.choices]
        vectors = [embedding_floats(c.embedding) for c in self.gen.choices]
        return [_dot(vectors[i], vectors[j]) for i, j in self.pairs]

    def body(self) -> bytes:
        n = self.gen.num_prompt_tokens
        return orjson.dumps({"id": self.gen.api_id, "object": "list", "created": self.created, "model": self.model,
                             "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(self._scores())],
                             "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})


async def rerank_job(api, data: dict, arrival: float | None = None) -> tuple[Generation, RerankFormat]:
    query = _texts(data, "query", False)
    documents = _texts(data, "documents", True)
    top_n = op.whole(data.get("top_n", 0))
    if isinstance(top_n, bool) or not isinstance(top_n, int | type(None)) or (top_n or 0) < 0:
        raise ApiError(400, f"top_n must be a non-negative integer, got {top_n!r}", param="top_n")
    with_documents = data.get("return_documents", True)
    if not isinstance(with_documents, bool):
        raise ApiError(400, "return_documents must be true or false", param="return_documents")
    cross = _cross_encoder(api)
    if cross:
        gen = await _cross_encoded(api, data, [(query[0], d) for d in documents], arrival, "rerank")
    else:
        gen = await _embedded(api, data, [("query", query), ("documents", documents)], arrival, "rerank")
    return gen, RerankFormat(gen.lora or api.model, gen, documents, top_n or 0, with_documents, cross)


async def score_job(api, data: dict, arrival: float | None = None) -> tuple[Generation, ScoreFormat]:
    first, second = _texts(data, "text_1", True), _texts(data, "text_2", True)
    if len(first) == 1:
        pairs = [(0, 1 + j) for j in range(len(second))]
    elif len(first) == len(second):
        pairs = [(i, len(first) + i) for i in range(len(first))]
    else:
        raise ApiError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
                       "many as text_2", param="text_2")
    cross = _cross_encoder(api)
    if cross:
        texts = first + second
        gen = await _cross_encoded(api, data, [(texts[i], texts[j]) for i, j in pairs], arrival, "score")
    else:
        gen = await _embedded(api, data, [("text_1", first), ("text_2", second)], arrival, "score")
    return gen, ScoreFormat(gen.lora or api.model, gen, pairs, cross)
