"""The OpenAI API end to end: a frontend process against the fake engine of ``tools/fake_engine.py``.

The fake engine "generates" the prompt's own tokens again (cyclically) until
max_tokens or a stop token id, one token per request per step, and records
ADDs and ABORTs so tests can assert what the frontend told the engine.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import threading
import time

import openai
import pytest

from engine.protocol import Error
from frontends.errors import ApiError
from frontends.http import HttpConfig
from tools.fake_engine import (
    KEY,
    MAX_MODEL_LEN,
    MODEL,
    VOCAB,
    FakeEngine,
    PrefixCache,
    fake_stack,
    free_port,
    start_frontend,
    stop_frontend,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_tokenizer_dir):
    with fake_stack(str(tmp_path_factory.mktemp("eng")), smollm_tokenizer_dir,
                    http=HttpConfig(max_body_bytes=64 * 1024)) as stack:
        yield stack


@pytest.fixture(scope="module")
def tok(smollm_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_tokenizer_dir)


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack[1]}/v1", api_key=KEY, max_retries=0)


class Resp:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code, self.content = status, body
        self.text = body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


def call(port: int, method: str, path: str, body=None, key: str | None = KEY, raw: bytes | None = None,
         timeout: float = 10) -> Resp:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is not None or raw is not None:
        headers["Content-Type"] = "application/json"
    content = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=content, headers=headers)
        r = conn.getresponse()
        return Resp(r.status, r.read())
    finally:
        conn.close()


def post(port: int, path: str, body, key: str | None = KEY, raw: bytes | None = None, timeout: float = 10) -> Resp:
    return call(port, "POST", path, body, key, raw if raw is not None else None, timeout)


def get(port: int, path: str, key: str | None = KEY) -> Resp:
    return call(port, "GET", path, key=key)


# ----------------------------------------------------------------------------- happy paths


def test_completion_text_and_usage(client, tok):
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids))
    assert r.choices[0].text == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(ids), 2 * len(ids))


def test_completion_string_prompts_batch_and_n(client, stack, tok):
    r = client.completions.create(model=MODEL, prompt=["hello world", "good bye"], max_tokens=3, n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    adds = stack[0].adds[-4:]
    assert [a.params.seed for a in adds] == [7, 8, 7, 8]
    assert all(a.params.max_tokens == 3 for a in adds)


def test_default_max_tokens(client, stack, tok):
    client.completions.create(model=MODEL, prompt="hi there", max_tokens=None)
    assert stack[0].adds[-1].params.max_tokens == 16
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert stack[0].adds[-1].params.max_tokens == 2
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4)
    assert r.usage.completion_tokens == 4
    prompt_len = r.usage.prompt_tokens
    post(stack[1], "/v1/chat/completions", {"messages": msgs, "stop_token_ids": [2]})
    assert stack[0].adds[-1].params.max_tokens == MAX_MODEL_LEN - prompt_len


def test_echo_and_logprobs(client, tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text == "one two three" + tok.decode(ids[:2])
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.token_logprobs[-1] == -0.5
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len("one two three")
    assert len(lp.top_logprobs[-1]) == 2


def test_an_echoed_prompt_cut_inside_a_character_reads_as_the_decode_of_prompt_and_output(client, tok):
    """Prompt ids that end inside a character the output finishes: echo and output together are the decode of
    both, streamed or not (the fake engine answers with the prompt's own tokens, from its first: here the byte
    that finishes the character)."""
    hello = tok.encode("Hello ꙮ", add_special_tokens=False)  # the character is its last three tokens
    prompt = [hello[-1], *hello[:-1]]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, stream=stream,
                                      extra_body={"return_token_ids": True})
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == tok.decode(prompt + prompt[:2]) and "ꙮ" in text and "\ufffd\ufffd" not in text, (stream, text)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, stream=stream, logprobs=1)
        offsets = [o for c in (list(r) if stream else [r]) if c.choices for o in c.choices[0].logprobs.text_offset]
        # token by token, the output's after the prompt's (a byte token counts one): never back (review AA)
        assert len(offsets) == len(prompt) + 2 and offsets == sorted(offsets) and offsets[len(prompt)] > offsets[
            len(prompt) - 1], (stream, offsets)


def test_chat_and_chat_logprobs(client, tok):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2)
    m = r.choices[0]
    assert m.message.role == "assistant" and isinstance(m.message.content, str)
    assert len(m.logprobs.content) == 3
    assert m.logprobs.content[0].logprob == -0.5 and len(m.logprobs.content[0].top_logprobs) == 2
    assert r.object == "chat.completion" and r.usage.completion_tokens == 3


def test_logprobs_name_tokens_by_id_when_asked(client, tok):
    """vLLM's return_tokens_as_token_ids (its --return-tokens-as-token-ids for every request): "token_id:N",
    offsets and bytes still the text's."""
    ids = tok.encode("one two three", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, logprobs=2, echo=True,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids + ids[:2]]
    assert lp.text_offset[len(ids)] == len("one two three") and set(lp.top_logprobs[-1]) == {
        f"token_id:{ids[1]}", f"token_id:{ids[1] + 1}"}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=True, top_logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    first = r.choices[0].logprobs.content[0]
    assert first.token.startswith("token_id:") and bytes(first.bytes).decode() == tok.decode([int(first.token[9:])])


def test_stream_completion_with_usage(client, tok):
    ids = tok.encode("streaming tokens one at a time", add_special_tokens=False)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "streaming tokens one at a time"
    assert chunks[-1].usage.completion_tokens == len(ids) and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stream_continuous_usage_stats_in_every_chunk(client, tok):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far, the last one the
    whole; only with include_usage, as in vLLM."""
    ids = tok.encode("streaming tokens one at a time", add_special_tokens=False)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for chunks in (list(client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stream=True,
                                                  stream_options=opts)),
                   list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=len(ids), stream=True, stream_options=opts))):
        counts = [c.usage.completion_tokens for c in chunks]  # (the fake engine's tokens may come all at once)
        assert counts == sorted(counts) and counts[-1] == counts[-2] == len(ids)
        assert counts[0] == 0 or chunks[0].object == "text_completion"  # (a chat's role chunk, as in vLLM)
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == chunks[0].usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=2, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in chunks)
    with pytest.raises(openai.BadRequestError, match="continuous_usage_stats"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=2, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": "yes"})
    with pytest.raises(openai.BadRequestError, match=r"stream_options is only for streamed answers"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       stream_options={"include_usage": True})


def test_stream_chat_role_first(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_n2(client, tok):
    ids = tok.encode("abc def", add_special_tokens=False)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), n=2, stream=True))
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == ["abc def", "abc def"]


def test_stop_string_cut_and_engine_aborted(client, stack, tok):
    ids = tok.encode("Hello world. STOP here and more text after", add_special_tokens=False)
    stack[0].step_delay = 0.01  # so the stop string is seen while the engine still runs it
    try:
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=["STOP"])
    finally:
        stack[0].step_delay = 0.0
    assert r.choices[0].text == "Hello world. "
    assert r.choices[0].finish_reason == "stop"
    time.sleep(0.1)
    assert stack[0].adds[-1].request_id in stack[0].aborts


def test_stop_string_held_back_while_streaming(client, tok):
    ids = tok.encode("aaa bbb ccc ddd eee", add_special_tokens=False)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=["ccc dd"],
                                            stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == "aaa bbb "
    assert not any("cc" in t for t in texts)
    # as in vLLM, each streamed choice carries stop_reason: null until its last chunk, then the stop string
    reasons = [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices]
    assert reasons[-1] == "ccc dd" and set(reasons[:-1]) <= {None}
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "aaa bbb ccc ddd"}],
                                               max_tokens=64, stop=["ccc dd"], stream=True))  # (the template, echoed)
    reasons = [c.choices[0].model_extra.get("stop_reason") for c in chat if c.choices]
    assert reasons[-1] == "ccc dd" and set(reasons[:-1]) <= {None}
    # a held-back prefix that never completes comes out at the end
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=["eee fff"],
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "aaa bbb ccc ddd eee"


def test_stop_reason_and_min_tokens_hold_stop_strings(stack, tok):
    ids = tok.encode("aaa bbb ccc ddd eee", add_special_tokens=False)
    body = {"model": MODEL, "prompt": ids, "max_tokens": len(ids), "stop": ["bbb"]}
    choice = post(stack[1], "/v1/completions", body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("aaa ", "stop", "bbb")
    # as in vLLM, stop strings are not looked for before min_tokens tokens exist
    choice = post(stack[1], "/v1/completions", {**body, "min_tokens": len(ids)}).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("aaa bbb ccc ddd eee", "length")


def test_a_suffix_and_a_requests_own_chat_template_are_refused_not_ignored(stack):
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 3}
    _err(post(stack[1], "/v1/completions", {**body, "suffix": "\nprint(add(1, 2))"}), 400, "invalid_request_error",
         "suffix")
    assert post(stack[1], "/v1/completions", {**body, "suffix": None}).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    _err(post(stack[1], "/v1/chat/completions", {**chat, "chat_template": "{{ raise_exception('boom') }}"}), 400,
         "invalid_request_error", "chat_template")


def test_n_with_the_largest_seed(stack):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "seed": 2**64 - 1}
    r = post(stack[1], "/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert [a.params.seed for a in stack[0].adds[-2:]] == [2**64 - 1, 0]  # choice i: seed + i, mod 2**64
    _err(post(stack[1], "/v1/completions", {**body, "seed": 2**64}), 400, "invalid_request_error", "seed")


def test_utf8_split_across_tokens(client, tok):
    text = "中文 🎉 ok"
    ids = tok.encode(text, add_special_tokens=False)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stream=True))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_models_version_tokenize_detokenize(client, stack, tok):
    port = stack[1]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert get(port, "/version").json()["version"]
    t = post(port, "/tokenize", {"prompt": "hello world"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == MAX_MODEL_LEN
    assert post(port, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"].endswith("hello world")
    special = [tok.all_special_ids[0], *t["tokens"]]  # (kept, as vLLM's tokenizer.decode keeps them: review AA)
    assert post(port, "/detokenize", {"tokens": special}).json()["prompt"] == tok.decode(special) != tok.decode(
        special, skip_special_tokens=True)
    c = post(port, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert c["count"] > 3
    assert "token_strs" not in t  # vLLM's return_token_strs: the vocabulary's spelling of each token
    s = post(port, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert s["tokens"] == t["tokens"] and s["token_strs"] == ["hello", "Ġworld"]
    assert post(port, "/tokenize", {"prompt": "x", "return_token_strs": "yes"}).status_code == 400


# ----------------------------------------------------------------------------- prefix cache: cache_salt, cached_tokens


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_cache_salt_reaches_the_engine(client, stack):
    engine = stack[0]
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    assert engine.adds[-1].cache_salt == "tenant-a"
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, n=2,
                                   extra_body={"cache_salt": "s" * 256})
    assert [a.cache_salt for a in engine.adds[-2:]] == ["s" * 256] * 2
    for extra in ({}, {"cache_salt": None}):  # absent and null: no salt
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=extra)
        assert engine.adds[-1].cache_salt == ""


def test_a_prompt_cache_key_is_checked(client):
    """OpenAI's prompt_cache_key (data parallel's affinity: test_data_parallel): a string of at most 256 characters,
    on chats, completions and Responses alike; null is none."""
    hi = [{"role": "user", "content": "x"}]
    assert client.chat.completions.create(model=MODEL, messages=hi, max_tokens=1, prompt_cache_key="conv-1").choices
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"prompt_cache_key": None})
    for bad in (5, "k" * 257):
        for create, body in ((client.chat.completions.create, {"messages": hi, "max_tokens": 1}),
                             (client.responses.create, {"input": "x"})):
            with pytest.raises(openai.BadRequestError) as e:
                create(model=MODEL, **body, extra_body={"prompt_cache_key": bad})
            assert e.value.body["param"] == "prompt_cache_key"
    with pytest.raises(openai.BadRequestError) as e:  # (checked before the prompt is weighed, as cache_salt: review)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 5000}],
                                       extra_body={"prompt_cache_key": 5})
    assert e.value.body["param"] == "prompt_cache_key"


def test_cached_tokens_in_completion_usage(client):
    """The fake engine caches whole blocks of 16 and never the last prompt token: 48 tokens hit 32."""
    prompt = list(range(1000, 1048))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert (first.usage.prompt_tokens, cached(first.usage)) == (48, 0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert (again.usage.prompt_tokens, cached(again.usage)) == (48, 32)
    salted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "b"})
    assert cached(salted.usage) == 0  # another salt: nothing shared
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and cached(chunks[-1].usage) == 32
    # two prompts, n=2: each prompt counted once, with the least hit of its choices (the new prompt's
    # first choice fills what its second then hits: it counts 0)
    r = client.completions.create(model=MODEL, prompt=[prompt, list(range(2000, 2040))], max_tokens=1, n=2)
    assert (r.usage.prompt_tokens, cached(r.usage)) == (88, 32)


def test_cached_tokens_in_chat_usage(client):
    msgs = [{"role": "system", "content": "You answer questions about the cached prefix test. " * 4},
            {"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert cached(first.usage) == 0 and first.usage.prompt_tokens > 48
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert cached(again.usage) == (again.usage.prompt_tokens - 1) // 16 * 16
    other_user = client.chat.completions.create(model=MODEL, messages=[msgs[0], {"role": "user", "content": "yo"}],
                                                max_tokens=2)
    assert 32 <= cached(other_user.usage) < cached(again.usage) + 16  # the shared system prompt's whole blocks
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and cached(chunks[-1].usage) == cached(again.usage)
    salted = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                            extra_body={"cache_salt": "tenant-z"})
    assert cached(salted.usage) == 0


def test_fake_engine_prefix_cache():
    pc = PrefixCache(num_blocks=5, block_size=4)
    a = list(range(10))  # two whole blocks and two tokens
    assert pc.admit(a) == 0 and len(pc.blocks) == 2
    assert pc.admit(a) == 8
    assert pc.admit(a[:8]) == 4  # a full match still computes its last token: one block short
    assert pc.admit(a[:6] + [99, 98, 97]) == 4  # diverges mid-block: the whole blocks before it
    assert pc.admit(a, "salt") == 0 and pc.admit(a, "salt") == 8
    assert (pc.num_prompt_tokens, pc.num_cached_tokens) == (57, 24) and pc.hit_rate == 24 / 57
    assert pc.num_evictions == 0 and len(pc.blocks) == 5
    pc.admit([50, 51, 52, 53, 54])  # one block more than fits: the least recently used goes, a's tail
    assert pc.num_evictions == 1 and pc.admit(a, "salt") == 8 and pc.admit(a) == 4
    pc.reset()
    assert (len(pc.blocks), pc.num_evictions, pc.hit_rate) == (0, 0, 0.0)


def test_health(stack):
    r = get(stack[1], "/health", key=None)  # no key needed
    assert r.status_code == 200


def test_reset_prefix_cache_is_served_in_dev_mode_only(stack):
    """vLLM's POST /reset_prefix_cache exists with VLLM_SERVER_DEV_MODE=1 (test_server_e2e), else not."""
    assert post(stack[1], "/reset_prefix_cache", None).status_code == 404


def test_sagemakers_ping_and_invocations(stack, tok):
    """SageMaker's endpoints, as vLLM serves them: /ping (GET or POST, no key, no body) is /health; /invocations
    runs the API its body's fields name."""
    port = stack[1]
    assert get(port, "/ping", key=None).json()["status"] == "ok"
    assert call(port, "POST", "/ping", key=None).json()["status"] == "ok"
    ids = tok.encode("abc def", add_special_tokens=False)
    r = post(port, "/invocations", {"model": MODEL, "prompt": ids, "max_tokens": len(ids)}).json()
    assert (r["object"], r["choices"][0]["text"]) == ("text_completion", "abc def")
    r = post(port, "/invocations", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] == 2
    r = post(port, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    assert r.text.startswith("data: ") and r.text.endswith("data: [DONE]\n\n")
    r = post(port, "/invocations", {"model": MODEL, "input": "abc"}).json()
    assert r["object"] == "list" and len(r["data"][0]["embedding"]) > 0
    _err(post(port, "/invocations", {"model": MODEL, "text": "abc"}), 400)
    assert "'messages' (chat completions)" in post(port, "/invocations", {}).json()["error"]["message"]
    _err(post(port, "/invocations", {"prompt": "x", "max_tokens": -1}), 400)
    _err(post(port, "/invocations", {"prompt": "x"}, key=None), 401)


# ----------------------------------------------------------------------------- errors


def _err(r, status: int, typ: str | None = None, param: str | None = None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    if typ:
        assert e["type"] == typ
    if param:
        assert e["param"] == param
    return e


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, VOCAB]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "cache_salt": 5}, "cache_salt"),
    ({"prompt": "x", "cache_salt": ["a"]}, "cache_salt"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "x", "cache_salt": "s" * 257}, "cache_salt"),
    ({"prompt": "x", "max_tokens": 3.5}, "max_tokens"),
    ({"prompt": "x", "n": 1e300}, "n"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),  # (fewer samples than answers)
    ({"prompt": "x", "n": 1, "best_of": 4}, "best_of"),  # (not done, so not silently ignored: as vLLM V1)
    ({"prompt": "x", "best_of": "2"}, "best_of"),
])
def test_bad_completion_requests(stack, body, param):
    _err(post(stack[1], "/v1/completions", body), 400, "invalid_request_error", param)


def test_an_integer_outside_64_bits_is_called_so(stack):
    e = _err(post(stack[1], "/v1/completions", {"prompt": "x", "priority": 2**70}), 400, param="priority")
    assert "got a whole number outside the 64-bit range" in e["message"]


def test_best_of_no_op_values_are_taken(stack):
    """best_of equal to n, or 1 beside any n (LangChain's default): what was asked is done."""
    for body in ({"n": 2, "best_of": 2}, {"n": 2, "best_of": 1}, {"best_of": None}):
        r = post(stack[1], "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 200 and len(r.json()["choices"]) == body.get("n", 1), r.text


def test_whole_floats_are_taken_for_integers(stack):
    """4.0 where an integer is wanted is 4, as vLLM's pydantic models take it (a client computing its numbers
    sends them so); 3.5 is refused (above)."""
    engine, port = stack
    r = post(port, "/v1/completions", {"prompt": [1000, 1001], "max_tokens": 3.0, "n": 2.0, "top_k": 5.0,
                                        "seed": 7.0, "logprobs": 1.0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 6
    params = engine.adds[-2].params  # (the first choice's: the second's seed is the next)
    assert (params.max_tokens, params.top_k, params.seed, params.logprobs) == (3, 5, 7, 1)
    assert all(type(v) is int for v in (params.max_tokens, params.top_k, params.seed, params.logprobs))
    # the fields read outside field(): Anthropic's max_tokens, llama.cpp's logprobs fallback, rerank's top_n
    r = post(port, "/v1/messages", {"model": MODEL, "max_tokens": 3.0, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and engine.adds[-1].params.max_tokens == 3, r.text
    r = post(port, "/completion", {"prompt": [1000, 1001], "n_predict": 2, "logprobs": 2.0})
    assert r.status_code == 200 and engine.adds[-1].params.logprobs == 2, r.text
    r = post(port, "/v1/rerank", {"query": "a", "documents": ["b", "c", "d"], "top_n": 2.0})
    assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text


def test_context_overflow_states_the_numbers(stack):
    e = _err(post(stack[1], "/v1/completions", {"prompt": [5] * 500, "max_tokens": 20}), 400)
    assert "512" in e["message"] and "500" in e["message"] and "20" in e["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "cache_salt": True}, "cache_salt"),
    ({"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, "cache_salt"),
    ({"messages": [{"role": "user", "content": "x"}], "cache_salt": "s" * 257}, "cache_salt"),
])
def test_bad_chat_requests(stack, body, param):
    _err(post(stack[1], "/v1/chat/completions", body), 400, "invalid_request_error", param)


def test_a_text_part_without_text_is_named_so():
    from frontends.openai_params import parse_messages

    for part in ({"type": "text"}, {"type": "text", "text": 5}):  # (not "only text parts are supported": review AA)
        with pytest.raises(ApiError, match=r"messages\[0\]\.content: a text part needs text, a string"):
            parse_messages({"messages": [{"role": "user", "content": [part]}]})


def test_malformed_json_and_not_object(stack):
    _err(post(stack[1], "/v1/completions", None, raw=b"{nope"), 400, "invalid_request_error")
    _err(post(stack[1], "/v1/completions", None, raw=b"[1, 2]"), 400, "invalid_request_error")


def test_code_is_the_errors_name_else_its_status(stack):
    # one rule for every body (review AA: the HTTP layer's said 404, a handler's the same 400 null)
    assert _err(post(stack[1], "/v1/completions", {"prompt": "x", "temperature": -1}), 400)["code"] == 400
    assert _err(post(stack[1], "/v1/completions", None, raw=b"{nope"), 400)["code"] == 400
    assert _err(post(stack[1], "/v1/nowhere", {}), 404)["code"] == 404
    assert _err(post(stack[1], "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)["code"] == "model_not_found"
    assert ApiError(503, "x").body() == b'{"error":{"message":"x","type":"service_unavailable_error","param":null,"code":503}}'


def test_unknown_model(stack):
    e = _err(post(stack[1], "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found"


def test_auth(stack):
    _err(post(stack[1], "/v1/completions", {"prompt": "x"}, key=None), 401, "authentication_error")
    _err(post(stack[1], "/v1/completions", {"prompt": "x"}, key="wrong"), 401)
    _err(get(stack[1], "/v1/models", key=None), 401)
    _err(get(stack[1], "/v1/models", key=KEY + "x"), 401)


def test_routing_errors_and_body_limit(stack):
    port = stack[1]
    _err(get(port, "/v1/completions"), 405)
    _err(get(port, "/nope"), 404)
    _err(post(port, "/v1/completions", None, raw=b'{"prompt": "' + b"x" * 70000 + b'"}'), 413)


@pytest.mark.parametrize("path,shape,unknown", [
    ("/v1/messages", lambda b: b["type"] == "error" and {"type", "message"} <= set(b["error"]),  # Anthropic's
     "/v1/messages/nope"),
    ("/api/generate", lambda b: set(b) == {"error"} and isinstance(b["error"], str), "/api/nope"),  # Ollama's
    ("/generate", lambda b: set(b) == {"error", "error_type"}, None),  # TGI's
    ("/completion", lambda b: set(b["error"]) == {"code", "message", "type"}, None),  # llama.cpp's
])
def test_refusals_before_routing_come_in_the_routes_own_shape(stack, path, shape, unknown):
    """A wrong method (405, with its Allow header), a body past the limit (413), headers past theirs (431)
    and, under an API's own prefix, a path no route takes (404) are refused before any handler runs; they
    are written in the error shape of the API the path belongs to, as the handler's own refusals are."""
    port = stack[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 405 and shape(body) and "not allowed" in str(body) and "POST" in r.getheader("allow"), body
    conn.close()
    r = post(port, path, None, raw=b'{"prompt": "' + b"x" * 70000 + b'"}')
    assert r.status_code == 413 and shape(r.json()) and "too large" in r.text, r.text
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=b"{}", headers={"X-Big": "a" * 70000})
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 431 and shape(body), body
    conn.close()
    if unknown:
        r = post(port, unknown, {})
        assert r.status_code == 404 and shape(r.json()), r.text


def test_engine_refusal_passes_status(stack, client):
    engine = stack[0]
    engine.refuse = Error(None, 429, "rate_limit_error", "queue full")
    try:
        _err(post(stack[1], "/v1/completions", {"prompt": "x"}), 429, "rate_limit_error")
        _err(post(stack[1], "/v1/completions", {"prompt": "x", "stream": True}), 429, "rate_limit_error")
    finally:
        engine.refuse = None
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=1).choices


def test_disconnect_aborts_engine_request(stack, tok):
    engine, port = stack
    engine.step_delay = 0.02
    try:
        for stream in (True, False):
            body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 400, "stream": stream}).encode()
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(0.3)
            rid = engine.adds[-1].request_id
            assert rid in engine.running
            s.close()
            deadline = time.time() + 3
            while rid not in engine.aborts and time.time() < deadline:
                time.sleep(0.02)
            assert rid in engine.aborts and rid not in engine.running
    finally:
        engine.step_delay = 0.0


# ----------------------------------------------------------------------------- engine death


def test_engine_death_gives_503(tmp_path, smollm_tokenizer_dir):
    addr = f"ipc://{tmp_path}/engine.sock"
    engine = FakeEngine(addr, step_delay=0.05)
    engine.start()
    port = free_port()
    proc = start_frontend(addr, smollm_tokenizer_dir, port, api_keys=())
    try:
        assert get(port, "/health").status_code == 200
        result = {}

        def long_request():
            result["r"] = post(port, "/v1/completions", {"prompt": [5, 6], "max_tokens": 300}, timeout=20)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.3)
        engine.stop()
        t.join(10)
        _err(result["r"], 503)
        deadline = time.time() + 5
        while get(port, "/health").status_code != 503 and time.time() < deadline:
            time.sleep(0.05)
        assert get(port, "/health").status_code == 503
        _err(post(port, "/v1/completions", {"prompt": "x"}), 503)
    finally:
        assert stop_frontend(proc) == 0


def test_a_stream_past_the_shutdown_grace_says_it_was_cut(tmp_path, smollm_tokenizer_dir):
    """SIGTERM: a stream still running at the end of the grace gets a 503 error event and its [DONE], and a whole
    answer a 503, before the connections close (the stream's body was cut with neither: curl's exit 18)."""
    addr = f"ipc://{tmp_path}/engine.sock"
    engine = FakeEngine(addr, step_delay=0.05)
    engine.start()
    port = free_port()
    proc = start_frontend(addr, smollm_tokenizer_dir, port, api_keys=(), shutdown_grace=0.5)
    try:
        streamed = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        streamed.request("POST", "/v1/completions", json.dumps({"prompt": [1000, 1001], "max_tokens": 300, "stream": True}),
                         {"Content-Type": "application/json"})
        whole = {}
        t = threading.Thread(target=lambda: whole.update(r=post(port, "/v1/completions",
                                                                {"prompt": [1000, 1001], "max_tokens": 300})))
        t.start()
        r = streamed.getresponse()
        assert r.status == 200 and r.read1(65536).startswith(b"data:")
        time.sleep(0.2)
        proc.terminate()
        events = [e for e in r.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shutting down" in error["message"] and "0.5s grace" in error["message"]
        t.join(10)
        _err(whole["r"], 503)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            stop_frontend(proc)
        engine.stop()


def _self_signed(tmp_path):
    """A key and a certificate for 127.0.0.1."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def test_https(tmp_path, smollm_tokenizer_dir):
    key, cert = _self_signed(tmp_path)
    # an encrypted key is said to be one (OpenSSL asked a terminal for its passphrase, and waited)
    from frontends.server import FrontendArgs, ssl_context

    locked = tmp_path / "locked.pem"
    subprocess.run(["openssl", "pkey", "-in", str(key), "-out", str(locked), "-aes256", "-passout", "pass:x"],
                   check=True, capture_output=True)
    with pytest.raises(ValueError, match="key is encrypted"):
        ssl_context(FrontendArgs("x", "x", MODEL, "127.0.0.1", 0, ssl_keyfile=str(locked), ssl_certfile=str(cert)))
    engine = FakeEngine(f"ipc://{tmp_path}/engine.sock")
    engine.start()
    port = free_port()
    proc = start_frontend(f"ipc://{tmp_path}/engine.sock", smollm_tokenizer_dir, port,
                          ssl_keyfile=str(key), ssl_certfile=str(cert), http=HttpConfig(header_timeout=1.0))
    try:
        # a handshake begun and left is closed after --header-timeout (it was asyncio's 60 s, uncounted)
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"\x16\x03\x01\x02")  # (the first bytes of a ClientHello)
        stalled.settimeout(5)
        assert stalled.recv(1024) == b""
        stalled.close()
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10,
                                           context=ssl.create_default_context(cafile=str(cert)))
        body = json.dumps({"model": MODEL, "prompt": [1000, 1001, 1002], "max_tokens": 3})
        conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}",
                                                       "Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
        with pytest.raises(OSError):  # plain HTTP on the TLS port gets no HTTP answer
            plain = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            plain.request("GET", "/health")
            plain.getresponse()
        # the HTTPS keep-alive connection is still open, idle: SIGTERM does not wait the grace (10 s) for its
        # client's TLS goodbye, which never comes (it used to)
        started = time.monotonic()
        assert stop_frontend(proc) == 0
        assert time.monotonic() - started < 5
    finally:
        if proc.poll() is None:
            stop_frontend(proc)
        engine.stop()


def test_a_tls_handshake_counts_as_a_connection(tmp_path, smollm_tokenizer_dir):
    """--max-connections counts a TLS connection from its accept: handshakes begun and left hold the places they
    take (they took none, for up to --header-timeout each), one more while none has waited a second is closed
    before its handshake, and a client then makes room by closing the one that has waited longest."""
    key, cert = _self_signed(tmp_path)
    engine = FakeEngine(f"ipc://{tmp_path}/engine.sock")
    engine.start()
    port = free_port()
    proc = start_frontend(f"ipc://{tmp_path}/engine.sock", smollm_tokenizer_dir, port, ssl_keyfile=str(key),
                          ssl_certfile=str(cert), http=HttpConfig(max_connections=2, header_timeout=20.0))
    stalled = []
    try:
        for _ in range(2):
            stalled.append(socket.create_connection(("127.0.0.1", port)))
            stalled[-1].sendall(b"\x16\x03\x01\x02")  # (the first bytes of a ClientHello)
        time.sleep(0.2)
        third = socket.create_connection(("127.0.0.1", port))
        third.settimeout(3)
        assert third.recv(1024) == b""  # closed, no handshake (it was served past the limit)
        time.sleep(1.0)
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        stalled[0].settimeout(3)
        assert stalled[0].recv(1024) == b""  # the oldest handshake made room
        stalled[1].settimeout(0.5)
        with pytest.raises(TimeoutError):
            stalled[1].recv(1024)
        conn.close()
    finally:
        for s in stalled:
            s.close()
        stop_frontend(proc)
        engine.stop()


# ----------------------------------------------------------------------------- the model's sampling defaults


def test_the_models_generation_config_fills_what_a_request_leaves_out(tmp_path, smollm_tokenizer_dir):
    """--generation-config auto (vLLM's default): a request without temperature, top_p, top_k... samples
    with the model's; one that gives them, with its own; a chat's max_tokens from max_new_tokens (a
    completion's stays OpenAI's 16)."""
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 7}
    with fake_stack(str(tmp_path), smollm_tokenizer_dir, sampling_defaults=defaults) as (engine, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        p = engine.adds[-1].params
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
            0.6, 0.95, 20, 0.0, 1.1, 7)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=1.0,
                                       top_p=1.0, max_tokens=3, extra_body={"top_k": 0, "repetition_penalty": 1.0})
        p = engine.adds[-1].params
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 0, 1.0, 3)
        client.completions.create(model=MODEL, prompt="hi")
        p = engine.adds[-1].params
        assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 16)


def test_an_overridden_max_new_tokens_caps_every_request(tmp_path, smollm_tokenizer_dir):
    """vLLM's rule: --override-generation-config's max_new_tokens (or a --generation-config DIR's) is a
    limit on every request, completions' and explicit ones too; the model's own only a chat's default."""
    from engine.model_path import max_tokens_cap

    assert max_tokens_cap("auto", {"max_tokens": 512}) is None
    assert max_tokens_cap("auto", {"max_tokens": 5}, {"max_new_tokens": 5}) == 5
    assert max_tokens_cap("/some/dir", {"max_tokens": 512}) == 512
    with fake_stack(str(tmp_path), smollm_tokenizer_dir, sampling_defaults={"max_tokens": 5},
                    max_tokens_cap=5) as (engine, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=30)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        client.completions.create(model=MODEL, prompt="hi")
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert [a.params.max_tokens for a in engine.adds[-4:]] == [5, 5, 5, 2]


def test_generation_defaults_read_as_vllm_reads_them(tmp_path):
    from engine.model_path import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 50, "top_p": 0.95, "max_new_tokens": 512, "eos_token_id": 2}))
    # top_k 50 is transformers' own default: no choice of the model's (vLLM reads the diff from it)
    assert generation_defaults("auto", str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 512}
    assert generation_defaults("vllm", str(tmp_path)) == {}
    assert generation_defaults("vllm", str(tmp_path), {"temperature": 0.2}) == {"temperature": 0.2}
    assert generation_defaults("auto", str(tmp_path), {"top_k": 5})["top_k"] == 5
    assert generation_defaults("auto", str(tmp_path / "model.gguf")) == {}  # a GGUF file: none
    with pytest.raises(FileNotFoundError, match="no generation_config.json there"):
        generation_defaults(str(tmp_path / "nowhere"), str(tmp_path))
    # an override's null drops the model's value; keys that are no sampling value are not read
    assert generation_defaults("auto", str(tmp_path), {"temperature": None, "do_sample": False}) == {
        "top_p": 0.95, "max_tokens": 512}
    for override, message in (({"top_p": 0}, "top_p must be in"), ({"max_new_tokens": 0}, "max_tokens"),
                              ({"top_k": "many"}, "top_k")):  # checked as a request's values are
        with pytest.raises(ValueError, match=message):
            generation_defaults("vllm", str(tmp_path), override)
    for text, message in (("{'temperature': 1}", "generation_config.json: Expecting property name"),
                          ("[1, 2]", "generation_config.json: not a JSON object")):
        (tmp_path / "generation_config.json").write_text(text)
        with pytest.raises(ValueError, match=message):
            generation_defaults("auto", str(tmp_path))
    with pytest.raises(ValueError, match="give auto, vllm or a folder"):
        generation_defaults("", str(tmp_path))


def test_several_served_model_names(tmp_path, smollm_tokenizer_dir):
    """vLLM's --served-model-name a b: a request may name any of them (others: 404), responses name the
    first, /v1/models lists them all, and /v1/models/{model} (the client's models.retrieve) shows each one's
    card, its name percent-encoded as the client sends it."""
    alias = "org/alias 1"
    with fake_stack(str(tmp_path), smollm_tokenizer_dir, model_aliases=[alias]) as (engine, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        r = client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.model == MODEL
        listed = client.models.list().data
        assert [m.id for m in listed] == [MODEL, alias]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="hi", max_tokens=2)
        for m in listed:
            assert client.models.retrieve(m.id) == m
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("other")
        assert e.value.body["code"] == "model_not_found" and "'other'" in e.value.body["message"]
        r = get(port, "/v1/models/org/alias%201")  # (a bare '/' is read as one too)
        assert r.status_code == 200 and r.json()["id"] == alias
        assert get(port, "/v1/models/").status_code == 404  # (the list is /v1/models)
        r = get(port, "/v1/models/" + "x" * 5000)  # (its id not said back whole: review)
        assert r.status_code == 404 and len(r.json()["error"]["message"]) < 300
        assert get(port, f"/v1/models/{MODEL}", key=None).status_code == 401  # (a key, as the list wants)
        r = call(port, "POST", f"/v1/models/{MODEL}")
        assert r.status_code == 405 and "allowed: GET, HEAD, OPTIONS" in r.json()["error"]["message"]
        r = call(port, "HEAD", f"/v1/models/{MODEL}")
        assert r.status_code == 200 and r.content == b""


def test_a_tokenizer_larger_than_the_model_is_named_at_start(tmp_path, smollm_tokenizer_dir):
    """--tokenizer with more tokens than the model has: the frontend says so (texts with them are refused)."""
    addr = f"ipc://{tmp_path}/engine.sock"
    engine = FakeEngine(addr)
    engine.vocab_size = 1000
    engine.start()
    log = open(tmp_path / "fe.log", "w+")
    try:
        proc = start_frontend(addr, smollm_tokenizer_dir, free_port(), stderr=log)
        assert stop_frontend(proc) == 0
    finally:
        engine.stop()
    log.seek(0)
    assert "has 49152 tokens, the model only 1000: texts holding the others are refused" in log.read()


def test_force_include_usage_ends_every_stream_with_its_usage(tmp_path, smollm_tokenizer_dir):
    """vLLM's --enable-force-include-usage: a stream that did not ask for it (stream_options) gets it too."""
    with fake_stack(str(tmp_path), smollm_tokenizer_dir, force_include_usage=True, tokens_as_ids=True) as (engine,
                                                                                                          port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, logprobs=0)  # (the server's flag)
        assert r.choices[0].logprobs.tokens[0].startswith("token_id:")
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
