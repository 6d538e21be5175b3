"""Ollama's own API (``frontends.ollama``): ``/api/generate``, ``/api/chat``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``, against ``tokenmill serve`` on the tiny llama (``tiny_server``) with Ollama's official Python client.
Greedy text equals the OpenAI endpoints' for the same prompt (a chat of one user message; ``raw``: the prompt as
it is), whole and streamed as JSON lines; refusals are Ollama's ``{"error"}``. (``/api/embed``: in
``tests/test_embeddings_api.py``, beside a server of embeddings.)"""

from __future__ import annotations

import json
import re
import struct

import pytest

from frontends.errors import ApiError
from frontends.ollama import gguf_architecture, keep_alive, options, response_format
from tests.conftest import TINY_KEY, http_call

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def client(tiny_server):
    import ollama

    return ollama.Client(host=tiny_server.url, headers={"Authorization": f"Bearer {TINY_KEY}"})


def post(server, path: str, body: dict) -> tuple[int, bytes, str]:
    status, raw, headers = http_call(server.port, path, body, TINY_KEY)
    return status, raw, headers["content-type"]


def openai(tiny_client, prompt: str, chat: bool, n: int = 8) -> str:
    if chat:
        r = tiny_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                temperature=0, max_tokens=n)
        return r.choices[0].message.content
    return tiny_client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=n).choices[0].text


# ---------------------------------------------------------------------------- units


def test_a_gguf_files_architecture_is_read_off_its_first_keys(tmp_path):
    def gguf(*kvs):  # (key, GGUF value type, packed value)
        out = struct.pack("<4sIQQ", b"GGUF", 3, 0, len(kvs))
        for key, kind, value in kvs:
            out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + value
        return out

    name = struct.pack("<Q", 5) + b"qwen3"
    (tmp_path / "a.gguf").write_bytes(gguf(("general.alignment", 4, struct.pack("<I", 32)),
                                           ("general.architecture", 8, name)))
    (tmp_path / "b.gguf").write_bytes(gguf(("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 0)),
                                           ("general.architecture", 8, name)))  # (after an array: not read)
    (tmp_path / "c.gguf").write_bytes(b"GGUF\x03\x00")  # (cut short)
    assert [gguf_architecture(str(tmp_path / f)) for f in ("a.gguf", "b.gguf", "c.gguf", "none.gguf")] == [
        "qwen3", "", "", ""]


def test_options_are_llama_cpps_names():
    assert options({"options": {"num_predict": 5, "temperature": 0.2, "repeat_penalty": 1.1, "repeat_last_n": 32,
                                "seed": -1, "num_ctx": 4096, "stop": ["\n"], "unknown": 1, "top_k": None}}) == {
        "max_tokens": 5, "temperature": 0.2, "repetition_penalty": 1.1, "repeat_last_n": 32, "stop": ["\n"]}
    assert options({"options": {"num_predict": -1, "seed": 7}}) == {"seed": 7}
    for opts, message in (({"temperature": "hot"}, 'option "temperature" must be of type float32'),
                          ({"num_predict": True}, 'option "num_predict" must be of type integer'),
                          ({"stop": [1]}, 'option "stop" must be of an array of strings'),
                          ({"stop": ["a", ""]}, 'option "stop" must not hold an empty string')):
        with pytest.raises(ApiError, match=message):
            options({"options": opts})
    with pytest.raises(ApiError, match='option "top_k" must be of type integer'):  # (past Go's int)
        options({"options": {"top_k": 2**64}})
    for good in (5, -1, "5m", "1h30m", "0", "+5m", "-1s", "10\u03bcs", "1.5h", None):  # (Go's durations)
        keep_alive({"keep_alive": good})
    for bad, message in (("abc", 'time: invalid duration "abc"'), ("5", 'time: invalid duration "5"'),
                         ([], "Unsupported type: 'list'")):
        with pytest.raises(ApiError, match=re.escape(message)):
            keep_alive({"keep_alive": bad})
    assert response_format("json") == {"type": "json_object"}
    assert response_format({"type": "object"})["json_schema"]["schema"] == {"type": "object"}
    assert response_format("") is None
    with pytest.raises(ApiError, match='invalid format: "yaml"'):
        response_format("yaml")


# ---------------------------------------------------------------------------- served


@pytest.mark.parametrize("finish,reason", [("stop", "stop"), ("length", "length"), ("timeout", "timeout"),
                                           ("abort", "length")])
def test_done_reason_says_a_timeout_was_one(finish, reason):
    """A request's ``timeout`` passing is "timeout", as on the OpenAI routes, never passed off as "length"
    (num_predict reached)."""
    from types import SimpleNamespace

    from frontends.ollama import OllamaFormat

    choice = SimpleNamespace(finish_reason=finish, num_prompt_tokens=3, num_cached_tokens=0, num_tokens=2,
                             first_token_at=None, last_token_at=None, prompt_ids=[1, 2, 3])
    fmt = OllamaFormat("m", SimpleNamespace(choices=[choice], sent_at=None, arrival=0.0), None, chat=False)
    assert fmt._stats()["done_reason"] == reason


def test_generate_whole_streamed_and_raw(tiny_server, tiny_client, client):
    want = openai(tiny_client, PROMPT, chat=True)
    r = client.generate(model="tiny", prompt=PROMPT, options=GREEDY)
    assert r.response == want and r.done and r.done_reason == "length" and r.eval_count == 8
    assert r.total_duration > 0 and r.prompt_eval_count > 0
    parts = list(client.generate(model="tiny", prompt=PROMPT, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == want and parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == 8
    raw = client.generate(model="tiny:latest", prompt=PROMPT, options=GREEDY, raw=True)
    assert raw.response == openai(tiny_client, PROMPT, chat=False)
    assert raw.context is None  # (as Ollama: no context for a raw prompt)
    # context: the prompt's tokens and the output's; sent back, the next prompt goes on after them
    ids = json.loads(post(tiny_server, "/tokenize", {"messages": [{"role": "user", "content": PROMPT}]})[1])["tokens"]
    assert r.context[:len(ids)] == ids and len(r.context) == len(ids) + 8
    more = client.generate(model="tiny", prompt="And of Italy?", context=r.context, options=GREEDY)
    assert more.context[:len(r.context)] == r.context and len(more.context) > len(r.context) + 8
    status, body, ctype = post(tiny_server, "/api/generate", {"model": "tiny", "prompt": PROMPT, "options": GREEDY})
    lines = body.decode().splitlines()
    assert status == 200 and ctype == "application/x-ndjson" and len(lines) >= 2  # (streamed unless stream is false)
    assert "".join(json.loads(x)["response"] for x in lines) == want


def test_chat_whole_and_streamed(tiny_client, client):
    want = openai(tiny_client, PROMPT, chat=True)
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat(model="tiny", messages=messages, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == want and r.done_reason == "length"
    parts = list(client.chat(model="tiny", messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == want and parts[-1].done
    r = client.chat(model="tiny", messages=messages, options={"num_predict": 16}, format={"type": "string",
                                                                                             "enum": ["yes", "no"]})
    assert json.loads(r.message.content) in ("yes", "no") and r.done_reason == "stop"
    # an earlier turn with a tool call and its result goes through the template
    history = [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "lookup", "arguments": {"city": "Paris"}}}]}, {"role": "tool", "content": "sunny",
                                                                             "tool_name": "lookup"}]
    assert isinstance(client.chat(model="tiny", messages=history, options=GREEDY).message.content, str)


def test_logprobs_in_ollamas_words(tiny_server, tiny_client, client):
    """``logprobs`` and ``top_logprobs`` (Ollama's since 0.12.11): each output token's text, logprob and bytes,
    with its likeliest alternatives, the OpenAI chat's own figures for the same greedy answer; streamed, each
    line has its own tokens'; the raw prompt's too. Out of range, or not a boolean: 400."""
    import ollama

    messages = [{"role": "user", "content": PROMPT}]
    lp = tiny_client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=3).choices[0].logprobs.content
    want = [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top_logprobs]}
            for e in lp]
    def same(got: list[dict]) -> bool:  # (the logprobs to float32 noise: a prefix-cache hit computes otherwise)
        def rounded(entries):
            return [{**e, "logprob": round(e["logprob"], 4)} | (
                {"top_logprobs": rounded(e["top_logprobs"])} if "top_logprobs" in e else {}) for e in entries]
        return rounded(got) == rounded(want)

    asked = {"logprobs": True, "top_logprobs": 3, "options": GREEDY, "stream": False}
    for path, body in (("/api/chat", {"messages": messages}), ("/api/generate", {"prompt": PROMPT})):
        status, raw, _ = post(tiny_server, path, {"model": "tiny", **body, **asked})
        assert status == 200 and same(json.loads(raw)["logprobs"])
        status, raw, _ = post(tiny_server, path, {"model": "tiny", **body, **asked, "stream": True})
        lines = [json.loads(x) for x in raw.decode().splitlines()]
        assert same([e for x in lines for e in x.get("logprobs", [])]) and len(lines) > 2
    r = client.chat(model="tiny", messages=messages, options=GREEDY, logprobs=True)  # (the official client)
    assert [(e.token, e.top_logprobs) for e in r.logprobs] == [(e["token"], None) for e in want]
    assert [e.logprob for e in r.logprobs] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
    raw = client.generate(model="tiny", prompt=PROMPT, options=GREEDY, raw=True, logprobs=True, top_logprobs=1)
    assert len(raw.logprobs) == raw.eval_count == 8 and all(len(e.top_logprobs) == 1 for e in raw.logprobs)
    assert client.chat(model="tiny", messages=messages, options=GREEDY, top_logprobs=3).logprobs is None
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=messages, options=GREEDY, logprobs=True, top_logprobs=21)
    assert e.value.status_code == 400 and "top_logprobs" in e.value.error
    status, raw, _ = post(tiny_server, "/api/chat", {"model": "tiny", "messages": messages, "logprobs": "yes"})
    assert status == 400 and "logprobs" in json.loads(raw)["error"]  # (the client would have made it True)


def test_models_and_refusals(tiny_server, client):
    import ollama

    tags = client.list()
    assert [m.model for m in tags.models] == ["tiny"] and tags.models[0].size > 0
    assert tags.models[0].details.context_length == 256 if hasattr(tags.models[0].details, "context_length") else True
    shown = client.show("tiny")
    assert "completion" in shown.capabilities and "tools" not in shown.capabilities  # (its template shows none)
    assert shown.modelinfo == {"general.architecture": "llama", "llama.context_length": 256}  # (as Ollama keys them)
    assert client.ps().models[0].name == "tiny"
    status, body, _ = post(tiny_server, "/api/generate", {"model": "tiny", "prompt": ""})
    assert status == 200 and json.loads(body)["done_reason"] == "load"  # (Ollama's "load the model" call)
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="nope", prompt="x")
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny", prompt="x", options={"temperature": "hot"})
    assert e.value.status_code == 400 and e.value.error == 'option "temperature" must be of type float32'
    # num_predict past the context: up to its end, as Ollama (not refused)
    r = client.chat(model="tiny", messages=[{"role": "user", "content": PROMPT}], options={"num_predict": 999,
                                                                                        "temperature": 0})
    assert r.done_reason in ("stop", "length") and r.eval_count <= 256 - r.prompt_eval_count
    r = client.generate(model="tiny", prompt=PROMPT, raw=True, options={"num_predict": 999, "temperature": 0})
    assert r.eval_count <= 256
    status, body, _ = post(tiny_server, "/api/generate", {"model": "tiny", "prompt": "x", "raw": True, "system": "s"})
    assert status == 400 and json.loads(body) == {"error": "raw mode does not support template, system, or context"}
    status, body, _ = post(tiny_server, "/api/chat", {"prompt": "x"})
    assert status == 400 and json.loads(body) == {"error": "model is required"}
    for body, message in (({"prompt": "x", "raw": True, "images": ["aGk="]}, "images go with a templated prompt"),
                          ({"prompt": "def f(", "suffix": "\n"}, '"tiny" does not support insert'),
                          ({"prompt": "x", "think": True}, '"tiny" does not support thinking'),
                          ({"prompt": "x", "think": "high", "raw": True}, '"tiny" does not support thinking'),
                          ({"prompt": "x", "min_tokens": 10, "options": {"num_predict": 2}}, "num_predict (2)"),
                          ({"prompt": ["x"]}, "'prompt' must be of type str"),
                          ({"prompt": "x", "keep_alive": "abc"}, 'time: invalid duration "abc"'),
                          ({"prompt": "x" * 400_000}, "The prompt is 400000 characters long"),  # (not "messages")
                          ({"prompt": "x", "system": "s" * 400_000}, "The system is 400000 characters long")):
        status, raw, _ = post(tiny_server, "/api/generate", {"model": "tiny", **body})
        assert status == 400 and message in json.loads(raw)["error"], raw
    status, raw, _ = post(tiny_server, "/api/generate", {"model": "tiny", "prompt": "x", "min_tokens": 10,
                                                         "options": {"num_predict": 2}})
    assert json.loads(raw) == {"error": "min_tokens (10) must not exceed num_predict (2)"}  # (said once)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    status, raw, _ = post(tiny_server, "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                     "tools": [tool]})  # (the tiny model's template shows none)
    assert status == 400 and json.loads(raw) == {"error": '"tiny" does not support tools'}
    for messages in ([{"role": "user", "content": []}], [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": [1]}}]}], [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": ""}}]}], [{"role": "assistant", "content": "", "thinking": 0}]):
        status, raw, _ = post(tiny_server, "/api/chat", {"model": "tiny", "messages": messages})
        assert status == 400 and "messages[0]" in json.loads(raw)["error"]
    status, body, _ = post(tiny_server, "/api/version", {})
    assert status == 405


@pytest.mark.parametrize("endpoint", ["tgi", "ollama"])
def test_bench_serving_streams_from_other_servers_apis(tiny_server, endpoint):
    """``tools/bench_serving.py --endpoint tgi | ollama``: TGI's /generate_stream and Ollama's /api/generate, read
    as their own events; tokenmill's ``ignore_eos`` taken beside their fields."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "bench_serving.py"), "--base-url",
                        tiny_server.url + "/v1", "--endpoint", endpoint, "--api-key", TINY_KEY, "--num-prompts", "4",
                        "--input-len", "16", "--output-len", "8", "--max-concurrency", "2", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["endpoint"] == endpoint and result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 4 * 8 and result["ttft_ms"]["median"] > 0  # (ignore_eos)
