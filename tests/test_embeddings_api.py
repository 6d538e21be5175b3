"""``POST /v1/embeddings`` on a real server (``tokenmill serve``, two frontends, ``--pooler-config``)
with the official ``openai`` client (which asks for base64 and decodes it) and raw HTTP: vectors equal
to ``LLM.embed``'s, OpenAI's response shape, vLLM's extra fields, clear 400s, and chats streaming
beside embeddings; ``/v1/rerank`` and ``/v1/score`` as the cosine similarities of those vectors."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import struct

import openai
import pytest

from engine import LLM
from tests.test_server_e2e import Server, openai_client

POOLER = '{"pooling_type": "MEAN"}'
TEXTS = ["Hello, my name is", "The capital of France is", "Once upon a time " * 20]


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--dtype", "float32", "--pooler-config", POOLER,
               "--max-model-len", "256", api_server_count=2)
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, pooler_config={"pooling_type": "mean"})
    return {o.prompt: o for o in llm.embed(TEXTS)}


def post(server: Server, body: dict, path: str = "/v1/embeddings") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("encoding", [openai.NOT_GIVEN, "float"], ids=["base64", "float"])
def test_the_openai_client_gets_the_offline_vectors(server, offline, encoding):
    client = openai_client(server)
    r = client.embeddings.create(model="tiny", input=TEXTS, encoding_format=encoding)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "tiny" and r.object == "list"
    for text, d in zip(TEXTS, r.data, strict=True):
        assert close(d.embedding, offline[text].embedding), text
        assert math.isclose(sum(x * x for x in d.embedding), 1.0, rel_tol=1e-4)  # normalized by default
    n = sum(len(offline[t].prompt_token_ids) for t in TEXTS)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (n, n)


def test_raw_shape_token_ids_dimensions_and_truncation(server, offline):
    ids = offline[TEXTS[2]].prompt_token_ids
    status, body = post(server, {"input": [ids, ids[-5:]], "dimensions": 8, "truncate_prompt_tokens": 5,
                                 "normalize": False})
    assert status == 200, body
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["data"][0].keys() == {"object", "index", "embedding"} and body["data"][0]["object"] == "embedding"
    first, second = (d["embedding"] for d in body["data"])
    assert len(first) == 8 and close(first, second)  # both are the last 5 tokens
    assert body["usage"]["prompt_tokens"] == 10
    assert not math.isclose(sum(x * x for x in first), 1.0, rel_tol=1e-3)  # normalize: false


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [[1, -2]]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),  # the tiny model's hidden size is 64: the engine says
    ({"input": "hi", "normalize": "yes"}, "normalize"),
    ({"input": [list(range(300))]}, "input"),  # longer than --max-model-len 256
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": ["x"] * 2049}, "input"),  # OpenAI's limit
])
def test_bad_bodies_get_a_400_that_names_the_field(server, body, param):
    status, r = post(server, body)
    assert status == 400, r
    err = r["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_a_wrong_model_name_and_a_long_input_truncated(server):
    assert post(server, {"model": "nope", "input": "x"})[0] == 404
    status, r = post(server, {"input": [list(range(300))], "truncate_prompt_tokens": -1})
    assert status == 200 and r["usage"]["prompt_tokens"] == 256


def test_chats_stream_while_embeddings_are_computed(server, offline):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def chat() -> int:
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=24, stream=True, extra_body={"ignore_eos": True})
        return sum([1 async for c in stream if c.choices and c.choices[0].delta.content is not None])

    async def embed() -> list:
        return (await client.embeddings.create(model="tiny", input=TEXTS * 4)).data

    async def main():
        return await asyncio.gather(*[chat() for _ in range(4)], *[embed() for _ in range(4)])

    results = asyncio.run(main())
    assert all(n > 0 for n in results[:4])
    for data in results[4:]:
        assert all(close(d.embedding, offline[TEXTS[d.index % 3]].embedding) for d in data)


def test_a_text_longer_than_the_context_is_truncated_from_its_end(server, tiny_llama):
    """truncate_prompt_tokens on a text far longer than the context holds in characters: only its end is
    tokenized, and the vector is the one of the whole text's last k tokens."""
    from frontends.tokenizer import load_tokenizer

    text = " ".join(f"word{i}" for i in range(60000))  # ~470k characters
    status, r = post(server, {"input": text, "truncate_prompt_tokens": 40})
    assert status == 200 and r["usage"]["prompt_tokens"] == 40, r
    last = load_tokenizer(tiny_llama).encode(text)[-40:]
    status, want = post(server, {"input": [last]})
    assert close(r["data"][0]["embedding"], want["data"][0]["embedding"])
    assert post(server, {"input": text})[0] == 400  # without truncation: too long


def test_more_inputs_than_the_window_and_the_waiting_queue(server, offline):
    """2048 inputs (the server's waiting queue holds 1024; a call sends 2 x max_num_seqs at a time); a response
    this big (512 KiB of vectors) is written on a thread."""
    status, r = post(server, {"input": [TEXTS[0], TEXTS[1]] * 1024})
    assert status == 200 and len(r["data"]) == 2048
    assert all(close(d["embedding"], offline[TEXTS[d["index"] % 2]].embedding) for d in r["data"][::97])


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # (normalized vectors)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_cosine_similarity(server, offline, path):
    query, docs = TEXTS[0], [TEXTS[1], {"text": TEXTS[2]}, TEXTS[0]]
    status, r = post(server, {"model": "tiny", "query": query, "documents": docs, "top_n": 2}, path)
    assert status == 200, r
    want = sorted(((cosine(offline[query].embedding, offline[t].embedding), i)
                   for i, t in enumerate([TEXTS[1], TEXTS[2], TEXTS[0]])), reverse=True)
    assert [x["index"] for x in r["results"]] == [i for _, i in want[:2]] and r["results"][0]["index"] == 2
    for x, (score, i) in zip(r["results"], want, strict=False):
        assert abs(x["relevance_score"] - score) < 1e-5 and x["document"]["text"] == [TEXTS[1], TEXTS[2], TEXTS[0]][i]
    n = len(offline[query].prompt_token_ids) + sum(len(offline[t].prompt_token_ids) for t in TEXTS)
    assert r["usage"]["total_tokens"] == n and r["model"] == "tiny"
    status, r = post(server, {"query": query, "documents": docs, "return_documents": False}, path)
    assert len(r["results"]) == 3 and all("document" not in x for x in r["results"])


def test_score_pairs_texts(server, offline):
    status, r = post(server, {"text_1": TEXTS[0], "text_2": TEXTS[1:]}, "/v1/score")
    assert status == 200 and [d["index"] for d in r["data"]] == [0, 1] and r["data"][0]["object"] == "score"
    assert all(abs(d["score"] - cosine(offline[TEXTS[0]].embedding, offline[t].embedding)) < 1e-5
               for d, t in zip(r["data"], TEXTS[1:], strict=True))
    status, r = post(server, {"text_1": TEXTS[0], "text_2": [TEXTS[0]] * 8}, "/score")  # a text with itself: 1,
    assert all(-1 <= d["score"] <= 1 for d in r["data"]) and r["data"][0]["score"] == pytest.approx(1)  # never past
    status, r = post(server, {"text_1": TEXTS[:2], "text_2": [TEXTS[2], TEXTS[0]]}, "/score")
    assert [round(d["score"], 4) for d in r["data"]] == [
        round(cosine(offline[a].embedding, offline[b].embedding), 4) for a, b in ((TEXTS[0], TEXTS[2]), (TEXTS[1], TEXTS[0]))]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", 3]}, "documents"),
    ("/v1/rerank", {"query": ["q"], "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "no"}, "return_documents"),
    ("/v1/rerank", {"query": "q", "documents": ["word " * 400]}, "documents"),  # longer than the context
    ("/v1/rerank", {"query": "word " * 400, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * 2048}, "documents"),  # 2049 texts with the query
    ("/v1/score", {"text_1": "word " * 400, "text_2": ["a", "b"]}, "text_1"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
])
def test_bad_rerank_and_score_bodies_get_a_400(server, path, body, param):
    status, r = post(server, body, path)
    assert status == 400 and r["error"]["param"] == param, r


def test_a_frontend_before_the_fake_engine_windows_a_large_call(smollm_tokenizer_dir, tmp_path):
    """``tools/fake_engine.py`` answers embedding requests too (for frontend benchmarks): 300 inputs come
    back in order, the engine never holding more than a window (2 x its max_num_seqs, 64) of them."""
    from tools.fake_engine import KEY, fake_embedding, fake_stack

    with fake_stack(str(tmp_path), smollm_tokenizer_dir) as (engine, port):
        held = []
        step = engine.step
        engine.step = lambda sock: held.append(len(engine.running)) or step(sock)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        inputs = [[i + 1, i + 2] for i in range(300)]
        conn.request("POST", "/v1/embeddings", json.dumps({"input": inputs, "dimensions": 8}),
                     {"content-type": "application/json", "authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 200 and [d["index"] for d in body["data"]] == list(range(300))
        want = json.loads(json.dumps(list(struct.unpack("<8f", fake_embedding(inputs[7], 8)))))
        assert body["data"][7]["embedding"] == want and body["usage"]["prompt_tokens"] == 600
        assert 0 < max(held) <= 128


def test_llama_cpp_s_embedding_route(server, offline):
    """llama.cpp's ``/embedding`` (``frontends.llamacpp``): ``content`` in, a vector in a list of one per input out."""
    status, body = post(server, {"content": TEXTS[0]}, "/embedding")
    assert status == 200 and body[0].keys() == {"index", "embedding"} and len(body[0]["embedding"]) == 1
    assert close(body[0]["embedding"][0], offline[TEXTS[0]].embedding)
    ids = offline[TEXTS[1]].prompt_token_ids
    status, body = post(server, {"input": [TEXTS[0], ids], "embd_normalize": -1}, "/embeddings")
    raw = post(server, {"input": [TEXTS[0], ids], "normalize": False})[1]["data"]
    assert status == 200 and [b["index"] for b in body] == [0, 1]
    assert all(close(b["embedding"][0], r["embedding"]) for b, r in zip(body, raw, strict=True))
    status, body = post(server, {"content": "x", "embd_normalize": 1}, "/embedding")
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "embd_normalize" in body["error"][
        "message"]
    status, body = post(server, {}, "/embedding")
    assert status == 400 and body["error"]["message"] == "Missing required field: 'content'"


def test_ollamas_embed_routes(server, offline):
    """Ollama's ``/api/embed`` (``frontends.ollama``) through its official client: the offline vectors; the older
    ``/api/embeddings``, one vector as pooled (not normalised)."""
    import ollama

    client = ollama.Client(host=server.url)
    out = client.embed(model="tiny", input=TEXTS[:2])
    assert out.model == "tiny" and len(out.embeddings) == 2 and out.prompt_eval_count > 0
    assert all(close(v, offline[t].embedding) for v, t in zip(out.embeddings, TEXTS, strict=False))
    assert close(client.embed(model="tiny:latest", input=TEXTS[0]).embeddings[0], offline[TEXTS[0]].embedding)
    raw = post(server, {"input": TEXTS[0], "normalize": False})[1]["data"][0]["embedding"]
    assert close(list(client.embeddings(model="tiny", prompt=TEXTS[0]).embedding), raw)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="nope", input="x")
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    status, body = post(server, {"model": "tiny", "input": 3}, "/api/embed")
    assert status == 400 and body == {"error": "invalid input type"}
