"""Scheduling fields end to end: ``priority`` and ``timeout`` in, "timeout" endings and 429s out.

A frontend process (HTTP) and an in-process frontend (WebSocket, ``serving`` of
``tests/test_websocket.py``) against one fake engine of ``tools/fake_engine.py``,
which ends a request whose deadline has passed at its next step with an empty
"timeout" delta. A ``timeout`` of 1e-6 s is past before the engine first steps
the request: zero tokens. A few tenths of a second with ``step_delay`` set gives
part of a generation.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import re
import time

import openai
import pytest
from websockets.asyncio.client import connect

from engine.protocol import Error, SamplingParams
from frontends.engine_client import EngineClient
from frontends.http import HttpConfig
from frontends.openai_params import MAX_TIMEOUT_S
from frontends.text import TextCodec
from frontends.tokenizer import load_tokenizer
from tests.test_frontend_openai import _err, get, post
from tests.test_websocket import AUTH, recv, run, serving
from tools.fake_engine import KEY, MODEL, FakeEngine, fake_stack, free_port, start_frontend, stop_frontend

CHAT = [{"role": "user", "content": "hi"}]
STATS_FIELDS = {"num_waiting", "num_running", "kv_usage", "num_free_blocks", "num_kv_blocks", "num_preemptions",
                "num_timeouts", "prefix_cache_hit_rate", "num_evictions", "kv_fragmentation", "num_spec_drafts",
                "num_spec_draft_tokens", "num_spec_accepted_tokens"}
INSTANT = 1e-6  # a timeout that has passed before the engine first steps the request


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = FakeEngine(f"ipc://{tmp_path_factory.mktemp('sched')}/engine.sock")
    e.start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def port(engine, smollm_tokenizer_dir):
    p = free_port()
    proc = start_frontend(engine.address, smollm_tokenizer_dir, p)
    yield p
    assert stop_frontend(proc) == 0


@pytest.fixture(scope="module")
def codec(smollm_tokenizer_dir):
    return TextCodec(load_tokenizer(smollm_tokenizer_dir))


@pytest.fixture
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(autouse=True)
def _reset_engine(engine):
    yield
    engine.step_delay = 0.0
    engine.refuse = None


def paced(engine) -> None:
    """20 tokens a second: a 0.3 s timeout ends a long generation after a few of them."""
    engine.step_delay = 0.05


def post_raw(port: int, path: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body: ``post`` of test_frontend_openai has no headers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {KEY}",
                                                      "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def sse_events(body: bytes) -> list:
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
            for line in body.split(b"\n\n") if line.startswith(b"data: ")]


# ----------------------------------------------------------------------------- what reaches the engine


def test_priority_and_timeout_reach_the_engine(engine, client):
    t0 = time.time()
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, n=2,
                              extra_body={"priority": -5, "timeout": 30})
    t1 = time.time()
    adds = engine.adds[-2:]
    assert [a.priority for a in adds] == [-5, -5]
    assert all(t0 + 30 <= a.deadline <= t1 + 30 for a in adds)
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"priority": 7})
    assert (engine.adds[-1].priority, engine.adds[-1].deadline) == (7, None)  # no timeout: the engine's default
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"timeout": 2.5})
    assert engine.adds[-1].priority == 0 and time.time() + 2 < engine.adds[-1].deadline <= time.time() + 2.5
    for p in (-(2**31), 2**31 - 1):  # the int32 range's ends are allowed
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": p})
        assert engine.adds[-1].priority == p
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"timeout": MAX_TIMEOUT_S})
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": -3.0})  # (as vLLM)
    assert engine.adds[-1].priority == -3 and type(engine.adds[-1].priority) is int


def test_the_servers_timeout_counts_from_when_the_frontend_reads_the_request(engine, codec):
    """``--request-timeout`` (READY's) is a request's deadline where it gives none, taken as the frontend reads the
    body, as a request's own ``timeout`` is: the engine applied it from the request's arrival there, after the
    frontend's tokenizing and queueing (review). Over HTTP, the WebSocket and embeddings alike."""
    async def main():
        engine.request_timeout = 40.0
        try:
            async with serving(engine, codec) as s:
                t0 = time.time()
                for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT}),
                                   ("/v1/embeddings", {"input": "x"}), ("/v1/completions", {"prompt": "x", "timeout": 5})):
                    r = await asyncio.to_thread(post, s.port, path, {"model": MODEL, "max_tokens": 1, **body}, KEY)
                    assert r.status_code == 200, r.text
                    want = 5 if "timeout" in body else 40
                    assert t0 + want <= engine.adds[-1].deadline <= time.time() + want, path
                async with connect(s.url, additional_headers=AUTH) as ws:
                    await ws.send(json.dumps({"type": "chat", "id": "c", "messages": CHAT, "max_tokens": 1}))
                    while (await recv(ws))["type"] != "done":
                        pass
                    assert t0 + 40 <= engine.adds[-1].deadline <= time.time() + 40
        finally:
            engine.request_timeout = None

    run(main())


def test_a_trusted_proxy_names_the_client_it_forwards(engine, codec):
    """Behind a reverse proxy every caller has the proxy's address: ``--forwarded-allow-ips`` (127.0.0.1 by
    default, as uvicorn's) names the proxies whose X-Forwarded-For says who the client is, for ``--fair-client
    address``, over HTTP and WebSocket; another peer's header is ignored."""
    def ask(port: int, forwarded: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "max_tokens": 1, "prompt": "x"}),
                         {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                          "X-Forwarded-For": forwarded})
            return conn.getresponse().status
        finally:
            conn.close()

    async def main():
        async with serving(engine, codec) as s:  # (the default: 127.0.0.1 is a trusted proxy)
            for forwarded, want in (("203.0.113.7", "addr:203.0.113.7"), ("evil, 198.51.100.2, 127.0.0.1",
                                                                          "addr:198.51.100.2")):
                assert await asyncio.to_thread(ask, s.port, forwarded) == 200
                assert engine.adds[-1].client == want
            async with connect(s.url, additional_headers={**AUTH, "X-Forwarded-For": "198.51.100.9"}) as ws:
                await ws.send(json.dumps({"type": "chat", "id": "c", "messages": CHAT, "max_tokens": 1}))
                while (await recv(ws))["type"] != "done":
                    pass
                assert engine.adds[-1].client == "addr:198.51.100.9"
        for trusted in ((), ("10.0.0.0/8",)):
            async with serving(engine, codec, http=HttpConfig(forwarded_allow_ips=trusted)) as s:
                assert await asyncio.to_thread(ask, s.port, "203.0.113.7") == 200
                assert engine.adds[-1].client == "addr:127.0.0.1"

    run(main())


def test_who_asks_reaches_the_engine(engine, client, port, codec):
    """``--scheduling-policy fair``'s unit: the caller's host (``--fair-client address``, the default: a ``user``
    is the caller's word, and one caller could name each request differently); with ``--fair-client key`` the
    API key it gave, by its place among the keys; with ``--fair-client user`` the body's end user (OpenAI's
    ``user`` or ``safety_identifier``, strings or a 400 in any mode; Anthropic's ``metadata.user_id``; a name past
    256 characters kept as its start and a digest), over HTTP and WebSocket alike."""
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, user="alice")
    assert engine.adds[-1].client == "addr:127.0.0.1"

    async def main():
        async with serving(engine, codec, api_keys=(KEY, "k2")) as s:
            s.api.fair_client = "key"
            for key, want in ((KEY, "key:0"), ("k2", "key:1")):
                r = await asyncio.to_thread(post, s.port, "/v1/completions",
                                            {"model": MODEL, "max_tokens": 1, "prompt": "x", "user": "u"}, key)
                assert r.status_code == 200 and engine.adds[-1].client == want
            for headers, subprotocols, want in ((AUTH, None, "key:0"), ({}, ["tokenmill.v1", "tokenmill.key.k2"],
                                                                          "key:1")):
                async with connect(s.url, additional_headers=headers, subprotocols=subprotocols) as ws:
                    await ws.send(json.dumps({"type": "chat", "id": "c", "messages": CHAT, "max_tokens": 1}))
                    while (await recv(ws))["type"] != "done":
                        pass
                    assert engine.adds[-1].client == want
            s.api.fair_client = "user"
            base = {"model": MODEL, "max_tokens": 1}
            for body, want in (({"user": "alice"}, ["user:alice"]), ({"safety_identifier": "h1", "n": 2}, ["user:h1"] * 2),
                               ({}, ["addr:127.0.0.1"]), ({"user": ""}, ["addr:127.0.0.1"]),
                               ({"user": "u" * 1000}, ["user:" + "u" * 224 + hashlib.blake2b(
                                   b"u" * 1000, digest_size=16).hexdigest()])):
                r = await asyncio.to_thread(post, s.port, "/v1/completions", {**base, "prompt": "x", **body})
                assert r.status_code == 200 and [a.client for a in engine.adds[-len(want):]] == want, body
            other = "u" * 256 + "v" * 744  # (the same first 256 characters: another user)
            r = await asyncio.to_thread(post, s.port, "/v1/completions", {**base, "prompt": "x", "user": other})
            assert r.status_code == 200 and engine.adds[-1].client != engine.adds[-2].client
            for s.api.fair_client in ("user", "address", "key"):  # (a number was taken for no user, silently: review)
                for name, value in (("user", 7), ("user", ["a"]), ("safety_identifier", {"a": 1})):
                    r = await asyncio.to_thread(post, s.port, "/v1/chat/completions",
                                                {**base, "messages": CHAT, name: value})
                    assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, value)
            s.api.fair_client = "user"
            r = await asyncio.to_thread(post, s.port, "/v1/messages", {**base, "messages": CHAT,
                                                                        "metadata": {"user_id": "bob"}})
            assert r.status_code == 200 and engine.adds[-1].client == "user:bob"
            async with connect(s.url, additional_headers=AUTH) as ws:
                for msg, want in (({"user": "carol"}, "user:carol"), ({}, "addr:127.0.0.1")):
                    await ws.send(json.dumps({"type": "chat", "id": "c", "messages": CHAT, "max_tokens": 1, **msg}))
                    while (await recv(ws))["type"] != "done":
                        pass
                    assert engine.adds[-1].client == want

    run(main())


@pytest.mark.parametrize("field,value", [
    ("priority", True), ("priority", 1.5), ("priority", "1"), ("priority", [1]),
    ("priority", 2**31), ("priority", -(2**31) - 1), ("priority", 10**30),
    ("timeout", 0), ("timeout", -1), ("timeout", -0.5), ("timeout", True), ("timeout", "5"), ("timeout", [5]),
    ("timeout", MAX_TIMEOUT_S + 1), ("timeout", 10**30), ("timeout", 1.7e308),
])
def test_bad_priority_and_timeout(engine, port, field, value):
    before = len(engine.adds)
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        e = _err(post(port, path, {**body, field: value}), 400, "invalid_request_error", field)
        assert field in e["message"]
    assert len(engine.adds) == before  # refused before anything reached the engine


def test_nan_and_infinity_are_not_json(port):
    # orjson refuses them, so they never reach the timeout check (which refuses them too)
    for raw in (b'{"prompt": "x", "timeout": NaN}', b'{"prompt": "x", "timeout": 1e400}'):
        _err(post(port, "/v1/completions", None, raw=raw), 400, "invalid_request_error")


def test_timeout_check_refuses_nan_and_inf():
    from frontends import openai_params as op
    from frontends.errors import ApiError

    for v in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ApiError) as e:
            op.parse_deadline({"timeout": v})
        assert e.value.param == "timeout"


# ----------------------------------------------------------------------------- timeout endings over HTTP


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_before_the_first_token_is_408(engine, port, stream):
    timeouts = engine.num_timeouts
    for path, body in (("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5}),
                       ("/v1/chat/completions", {"messages": CHAT, "n": 2})):
        status, headers, raw = post_raw(port, path, {**body, "timeout": INSTANT, "stream": stream})
        assert status == 408 and headers["content-type"] == "application/json", raw
        assert headers["x-should-retry"] == "false"  # else the openai clients send it again, twice
        e = json.loads(raw)["error"]
        assert e["type"] == "timeout_error" and "before producing a token" in e["message"]
    assert engine.num_timeouts == timeouts + 3


def test_a_call_larger_than_the_engine_queue_is_400_not_429(tmp_path, smollm_tokenizer_dir):
    e = FakeEngine(f"ipc://{tmp_path}/engine.sock")
    e.max_num_waiting_requests = 2
    e.start()
    p = free_port()
    proc = start_frontend(e.address, smollm_tokenizer_dir, p)
    try:
        status, headers, raw = post_raw(p, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 3})
        assert status == 400 and "retry-after" not in headers and json.loads(raw)["error"]["param"] == "n", raw
        status, _, raw = post_raw(p, "/v1/completions", {"prompt": ["x", "y", "z"], "max_tokens": 2})
        assert status == 400 and json.loads(raw)["error"]["param"] == "prompt", raw  # (the prompts are many)
        assert not e.adds
        assert post_raw(p, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2})[0] == 200
    finally:
        assert stop_frontend(proc) == 0
        e.stop()


def test_a_beam_searchs_later_rounds_are_not_refused_by_a_full_queue(tmp_path, smollm_tokenizer_dir):
    """Each round of a beam search is new engine requests. Once its first round is in, a full waiting queue
    must not end the search halfway with a 429 (its rounds lost): later rounds go as ``admitted``; a new
    request still gets the 429."""
    e = FakeEngine(f"ipc://{tmp_path}/engine.sock")
    e.room = 1  # the first round (the prompt alone: one beam); then the queue is full for new work
    e.start()
    p = free_port()
    proc = start_frontend(e.address, smollm_tokenizer_dir, p)
    try:
        body = {"prompt": "x", "max_tokens": 4, "n": 2, "use_beam_search": True, "ignore_eos": True}
        status, _, raw = post_raw(p, "/v1/completions", body)
        assert status == 200, raw
        assert [len(c["text"]) > 0 for c in json.loads(raw)["choices"]] == [True, True]
        rounds = [a.admitted for a in e.adds]
        assert rounds[0] is False and len(rounds) > 2 and all(rounds[1:]), rounds  # then 2 beams a round
        status, headers, raw = post_raw(p, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429 and "retry-after" in headers, raw
    finally:
        assert stop_frontend(proc) == 0
        e.stop()


def test_408_through_the_openai_client(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"timeout": INSTANT})
    assert e.value.status_code == 408


def test_partial_timeout_is_200_with_the_text_so_far(engine, client, port):
    paced(engine)
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=200, extra_body={"timeout": 0.3})
    assert r.choices[0].finish_reason == "timeout"
    assert 0 < r.usage.completion_tokens < 200 and r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, n=2,
                                       extra_body={"timeout": 0.3})
    assert [c.finish_reason for c in r.choices] == ["timeout", "timeout"]
    assert all(c.message.content for c in r.choices) and 0 < r.usage.completion_tokens < 400
    body = post(port, "/v1/completions", {"prompt": "hello world", "max_tokens": 200, "timeout": 0.3}).json()
    assert body["choices"][0]["finish_reason"] == "timeout" and body["choices"][0]["stop_reason"] is None


def test_partial_timeout_streams_a_timeout_chunk(engine, client):
    paced(engine)
    chunks = list(client.completions.create(model=MODEL, prompt="hello world", max_tokens=200, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"timeout": 0.3}))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "timeout" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and 0 < chunks[-1].usage.completion_tokens < 200
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, stream=True,
                                                 extra_body={"timeout": 0.3}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "timeout"


def test_every_streamed_choice_ends_with_timeout(engine, port):
    paced(engine)
    status, _, raw = post_raw(port, "/v1/completions", {"prompt": "hello world", "max_tokens": 200, "n": 2,
                                                        "timeout": 0.3, "stream": True})
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    ends = {c["index"]: c["finish_reason"] for ev in events[:-1] for c in ev["choices"] if c["finish_reason"]}
    assert ends == {0: "timeout", 1: "timeout"}


class _Client:
    """An EngineClient stand-in that records what a Generation sends."""

    def __init__(self) -> None:
        self.ready = None  # no handshake: no EOS ids known
        self.added: list[tuple] = []
        self.salts: list[str] = []
        self.aborted: list[str] = []

    def add(self, request_id, prompt_token_ids, params, priority=0, deadline=None, stream=None, cache_salt="", pooling=None,
            lora="", images=None, admitted=False, client_id=""):
        self.added.append((request_id, priority, deadline))
        self.salts.append(cache_salt)
        return stream

    def abort(self, request_ids) -> None:
        self.aborted += request_ids


def test_empty_timeout_deltas_flow_through_choices(codec):
    """A "timeout" delta with no token flushes the held-back text; only all-empty choices make a 408."""
    from engine.protocol import Delta
    from frontends.generation import Generation
    from frontends.text import StopMatcher

    ids = codec.encode("hello world")
    params = SamplingParams(max_tokens=50, stop=["world!"])
    client = _Client()
    gen = Generation(client, codec, "g", [ids], 2, lambda i: params, priority=3, stop=StopMatcher(["world!"]),
                     deadline=123.5)
    gen.start()
    assert client.added == [("g-0", 3, 123.5), ("g-1", 3, 123.5)]
    gen.stream.push(Delta("g-0", [], "timeout", num_prompt_tokens=len(ids)))
    gen.stream.push(Delta("g-1", ids, None, num_prompt_tokens=len(ids)))
    ups = {u.choice.index: u for u in asyncio.run(gen.next_updates())}
    assert (ups[0].finished, ups[0].text, ups[0].choice.finish_reason) == (True, "", "timeout")
    assert ups[1].text == "hello " and not ups[1].finished  # "world" may begin the stop string: held back
    gen.stream.push(Delta("g-1", [], "timeout"))
    (up,) = asyncio.run(gen.next_updates())
    assert (up.text, up.choice.finish_reason, up.choice.stop_reason) == ("world", "timeout", None)
    assert gen.done and not gen.timed_out_empty  # choice 1 has tokens: a 200 with its text

    gen = Generation(client, codec, "h", [ids], 2, lambda i: params)
    gen.start()
    gen.stream.push(Delta("h-0", [], "timeout"))
    gen.stream.push(Delta("h-1", [], "timeout"))
    asyncio.run(gen.next_updates())
    assert gen.timed_out_empty and client.aborted == []


def test_usage_counts_each_prompts_cached_tokens_once(codec):
    """Per prompt, the least hit of its n choices (each choice is an engine request of its own), summed."""
    from engine.protocol import Delta
    from frontends.generation import Generation

    a, b = list(range(100, 140)), list(range(200, 220))
    client = _Client()
    gen = Generation(client, codec, "u", [a, b], 3, lambda i: SamplingParams(max_tokens=1), cache_salt="t1")
    gen.start()
    assert client.salts == ["t1"] * 6
    assert gen.usage() == {"prompt_tokens": 60, "completion_tokens": 0, "total_tokens": 60,
                           "prompt_tokens_details": {"cached_tokens": 0}}
    for i, cached in enumerate((0, 32, 32, 16, 16, 16)):
        gen.stream.push(Delta(f"u-{i}", [7], "length", num_prompt_tokens=len(a if i < 3 else b),
                              num_cached_tokens=cached))
    asyncio.run(gen.next_updates())
    # prompt a: min(0, 32, 32) = 0; prompt b: 16
    assert gen.usage() == {"prompt_tokens": 60, "completion_tokens": 6, "total_tokens": 66,
                           "prompt_tokens_details": {"cached_tokens": 16}}


# ----------------------------------------------------------------------------- queue full, /health


def test_engine_queue_full_is_429_with_retry_after(engine, port, client):
    engine.refuse = Error(None, 429, "rate_limit_error", "waiting queue full")
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        for stream in (False, True):
            status, headers, raw = post_raw(port, path, {**body, "stream": stream})
            assert status == 429 and headers["retry-after"] == "1", raw
            assert json.loads(raw)["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert e.value.response.headers["retry-after"] == "1"


def test_health_shows_the_engines_latest_stats(engine, port):
    r = get(port, "/health", key=None)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    for _ in range(2):  # the second one hits the prefix cache: a hit rate above 0
        assert post(port, "/v1/completions", {"prompt": list(range(300, 340)), "max_tokens": 1}).status_code == 200
    engine.num_preemptions = 3  # the liveness pings (every 2 s) bring it
    try:
        deadline = time.monotonic() + 6
        while (h := get(port, "/health", key=None).json()).get("num_preemptions") != 3:
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
    finally:
        engine.num_preemptions = 0
    assert set(h) == {"status"} | STATS_FIELDS
    assert (h["num_kv_blocks"], h["num_free_blocks"], h["kv_usage"]) == (1000, 900, 0.1)
    assert h["num_timeouts"] == engine.num_timeouts
    pc = engine.prefix_cache
    assert h["prefix_cache_hit_rate"] == pc.hit_rate > 0 and h["num_evictions"] == pc.num_evictions
    assert 0 <= h["kv_fragmentation"] < 1


def test_health_is_503_while_the_engine_does_not_answer(tmp_path, smollm_tokenizer_dir):
    """An engine unanswered for a sixth of ``--engine-liveness-timeout`` (at least three of its pings: hung, a
    stopped worker, or in a step that long) makes ``/health`` a 503 saying so, long before its requests fail; its
    next answer makes it 200 again."""
    with fake_stack(str(tmp_path), smollm_tokenizer_dir, engine_liveness_timeout=6.0) as (engine, port):
        assert get(port, "/health", key=None).status_code == 200
        engine.mute = True  # it hangs: no outputs, no answers to the pings (every 0.75 s here)
        try:
            hung = time.monotonic()
            while (r := get(port, "/health", key=None)).status_code == 200:
                assert time.monotonic() - hung < 5, "still 200"
                time.sleep(0.1)
            assert time.monotonic() - hung > 2.0  # (stalled after 2.25 s: three pings)
            e = _err(r, 503, "service_unavailable_error")
            assert re.fullmatch(r"The engine has not answered for \d+s \(hung, or in a step that long\)", e["message"])
        finally:
            engine.mute = False
        deadline = time.monotonic() + 3  # (its answer to the next ping)
        while get(port, "/health", key=None).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_stats_stay_fresh_while_outputs_flow(engine):
    """A busy engine never goes quiet; the client pings it for stats all the same."""
    async def main():
        client = EngineClient(engine.address, "sched-live", handshake_timeout=5, liveness_interval=0.1)
        await client.connect()
        try:
            engine.step_delay = 0.01
            stream = client.add("busy", [5, 6, 7], SamplingParams(max_tokens=100_000))
            await stream.next_batch()
            seen = client.last_stats_at
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                await asyncio.wait_for(stream.next_batch(), 2)
            assert client.last_stats_at > seen and client.last_stats.num_running >= 1
            client.abort(["busy"])
        finally:
            await client.close()

    run(main())


# ----------------------------------------------------------------------------- WebSocket


def test_websocket_priority_timeout_and_endings(engine, codec):
    async def main():
        async with serving(engine, codec) as s:
            async with connect(s.url, additional_headers=AUTH) as ws:
                t0 = time.time()
                await ws.send(json.dumps({"type": "completion", "id": "a", "prompt": [5, 6], "max_tokens": 2,
                                          "priority": 4, "timeout": 60}))
                while (m := await recv(ws))["type"] != "done":
                    pass
                add = engine.adds[-1]
                assert (add.priority, m["finish_reason"], add.client) == (4, "length", "addr:127.0.0.1")
                assert t0 + 60 <= add.deadline <= time.time() + 60
                # a timeout before the first token: a done all the same, never an error
                await ws.send(json.dumps({"type": "chat", "id": "z", "messages": CHAT, "timeout": INSTANT}))
                m = await recv(ws)
                assert (m["type"], m["id"], m["finish_reason"]) == ("done", "z", "timeout")
                assert m["usage"]["completion_tokens"] == 0
                paced(engine)
                await ws.send(json.dumps({"type": "completion", "id": "p", "prompt": [5, 6], "max_tokens": 200,
                                          "timeout": 0.3}))
                deltas = 0
                while (m := await recv(ws))["type"] == "delta":
                    deltas += 1
                assert m["finish_reason"] == "timeout" and 0 < deltas == m["usage"]["completion_tokens"] < 200

    run(main())


def test_websocket_bad_fields_and_queue_full(engine, codec):
    async def main():
        async with serving(engine, codec) as s:
            async with connect(s.url, additional_headers=AUTH) as ws:
                for gid, extra, param in (("p", {"priority": 0.5}, "priority"), ("q", {"priority": 2**31}, "priority"),
                                          ("t", {"timeout": 0}, "timeout"), ("u", {"timeout": "1"}, "timeout")):
                    await ws.send(json.dumps({"type": "completion", "id": gid, "prompt": "x", **extra}))
                    m = await recv(ws)
                    assert (m["type"], m["id"], m["error"]["param"]) == ("error", gid, param)
                    assert "retry_after" not in m
                engine.refuse = Error(None, 429, "rate_limit_error", "waiting queue full")
                await ws.send(json.dumps({"type": "chat", "id": "full", "messages": CHAT}))
                m = await recv(ws)
                assert (m["type"], m["id"], m["retry_after"]) == ("error", "full", 1)
                assert m["error"]["type"] == "rate_limit_error" and m["error"]["code"] == 429

    run(main())


def test_websocket_stats_message_has_preemptions_and_timeouts(engine, codec):
    async def main():
        async with serving(engine, codec) as s:
            async with connect(s.url, additional_headers=AUTH) as ws:
                await ws.send(json.dumps({"type": "stats", "id": "s"}))
                return await recv(ws)

    engine.num_preemptions = 2
    try:
        m = run(main())
    finally:
        engine.num_preemptions = 0
    assert set(m) == {"type", "id"} | STATS_FIELDS
    assert (m["num_preemptions"], m["num_timeouts"]) == (2, engine.num_timeouts)


def test_a_windowed_generation_sends_one_more_request_as_one_ends(codec):
    """``Generation.start(window=3)`` (an embeddings call of many inputs): 3 requests at first, one more per
    end, none sent after the call is abandoned."""
    from engine.protocol import Delta, PoolingParams
    from frontends.generation import Generation

    client = _Client()
    gen = Generation(client, codec, "e", [[1, 2], [3], [4, 5], [6], [7]], 1, lambda i: SamplingParams(max_tokens=1))
    gen.pooling = PoolingParams()
    gen.start(window=3)
    assert [a[0] for a in client.added] == ["e-0", "e-1", "e-2"]
    gen.stream.push(Delta("e-1", [], "stop", num_prompt_tokens=1, embedding=b"\0\0\0\0"))
    asyncio.run(gen.next_updates())
    assert [a[0] for a in client.added] == ["e-0", "e-1", "e-2", "e-3"]
    gen.abort_unfinished()
    assert client.aborted == ["e-0", "e-2", "e-3", "e-4"] and len(client.added) == 4  # e-4 never sent
