"""Oversized requests against a real frontend process (fake engine): clear 400s, nothing sent on.

Each cap exists so that one request cannot make the frontend or the engine do
unbounded work: list sizes, prompts per call, prompts x n, the lists times n, and
text that cannot fit the context (refused before it is tokenized). Also here: the
streamed echo carries every choice's prompt logprobs, a stop string that straddles
``min_tokens`` is found, and big inputs are tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from engine.protocol import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from frontends import openai_params as op
from frontends.text import TextCodec, TokenizerBusy
from frontends.tokenizer import load_tokenizer
from tests.test_frontend_openai import call, post
from tools.fake_engine import MAX_MODEL_LEN, MODEL, FakeEngine, free_port, start_frontend, stop_frontend


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_tokenizer_dir):
    engine = FakeEngine(f"ipc://{tmp_path_factory.mktemp('limits')}/engine.sock")
    engine.start()
    port = free_port()
    proc = start_frontend(engine.address, smollm_tokenizer_dir, port)
    yield engine, port
    assert stop_frontend(proc) == 0
    engine.stop()


@pytest.fixture(scope="module")
def codec(smollm_tokenizer_dir):
    return TextCodec(load_tokenizer(smollm_tokenizer_dir))


def refused(stack, path: str, body: dict, param: str) -> str:
    engine, port = stack
    before = len(engine.adds)
    r = post(port, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert len(engine.adds) == before  # nothing reached the engine
    return err["message"]


CMPL = {"prompt": [5, 6, 7], "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body", [CMPL, CHAT], ids=["completions", "chat"])
def test_list_caps(stack, body):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    refused(stack, path, {**body, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop")
    refused(stack, path, {**body, "stop": ["x" * 1025]}, "stop")
    refused(stack, path, {**body, "stop_token_ids": [3] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids")
    refused(stack, path, {**body, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias")
    # the request: half a million stop ids, n=8
    refused(stack, path, {**body, "n": 8, "min_tokens": 1, "ignore_eos": True, "stop_token_ids": [3] * 500_000},
            "stop_token_ids")
    # each list within its cap, but times n more than one call may copy into the engine
    msg = refused(stack, path, {**body, "n": 16, "stop_token_ids": [3] * MAX_STOP_TOKEN_IDS}, "stop_token_ids")
    assert str(op.MAX_SAMPLING_ENTRIES) in msg
    refused(stack, path, {**body, "n": 16, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)}}, "logit_bias")
    # at the caps, with n=1: served
    r = post(stack[1], path, {"model": MODEL, **body, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)],
                              "stop_token_ids": [3] * MAX_STOP_TOKEN_IDS,
                              "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)}})
    assert r.status_code == 200, r.text


def test_prompt_count_and_fan_out_caps(stack):
    refused(stack, "/v1/completions", {"prompt": [[5]] * 50_000, "max_tokens": 1}, "prompt")
    msg = refused(stack, "/v1/completions", {"prompt": [[5]] * (op.MAX_PROMPTS + 1), "max_tokens": 1}, "prompt")
    assert f"At most {op.MAX_PROMPTS} prompts per request" in msg
    msg = refused(stack, "/v1/completions", {"prompt": [[5]] * 64, "n": 4, "max_tokens": 1}, "n")
    assert "64 x 4" in msg
    r = post(stack[1], "/v1/completions", {"model": MODEL, "prompt": [[5]] * 64, "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128


def test_text_that_cannot_fit_is_refused_before_tokenizing(stack, codec):
    max_chars = MAX_MODEL_LEN * codec.max_token_chars
    refused(stack, "/v1/completions", {"prompt": "a" * (max_chars + 1)}, "prompt")
    refused(stack, "/v1/completions", {"prompt": ["ok", "a" * (max_chars + 1)]}, "prompt")
    half = "a" * (max_chars // 2 + 1)
    refused(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": half},
                                                          {"role": "user", "content": half}]}, "messages")
    r = call(stack[1], "POST", "/tokenize", {"prompt": "a" * (max_chars + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_long_token_id_lists_are_checked_whole_and_the_first_bad_id_named():
    """Token ids are checked at C's pace (a body of four million of them held the event loop for a second in
    Python's walks: review), and still every one: the first that is no integer of the vocabulary is named."""
    ids = [5] * 1_000_000
    assert op.check_token_ids(ids, 100, "prompt") is ids
    for bad in (True, -1, 100, 5.0, "5", None):
        with pytest.raises(op.ApiError) as e:
            op.check_token_ids([*ids, bad, -2], 100, "prompt")
        assert f"Invalid token id {bad!r} in 'prompt'" in e.value.message
    prompts = asyncio.run(op.parse_prompts({"prompt": ids}, None, 100, 10))
    assert prompts == [ids]
    for bad in ([*ids, True], [*ids, "x"], [*ids, [5]]):  # (a list of ids and something else)
        with pytest.raises(op.ApiError, match="must be a string, a list of strings"):
            asyncio.run(op.parse_prompts({"prompt": bad}, None, 100, 10))


def test_big_inputs_are_tokenized_off_the_event_loop(codec):
    async def main():
        loop_thread = threading.get_ident()
        small = await codec.run(10, threading.get_ident)
        big = await codec.run(codec.INLINE_CHARS + 1, threading.get_ident)
        ids = await codec.run(codec.INLINE_CHARS + 1, codec.encode, "hello " * 1000, False)
        return loop_thread, small, big, ids

    loop_thread, small, big, ids = asyncio.run(main())
    assert small == loop_thread and big != loop_thread
    assert ids == codec.encode("hello " * 1000, False)


def _sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_streamed_echo_has_every_choices_prompt_logprobs(stack, codec):
    prompts = [codec.encode(t, add_special_tokens=False) for t in ("one two three", "four five", "six seven eight")]
    r = post(stack[1], "/v1/completions", {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 3,
                                            "echo": True, "logprobs": 1, "stream": True})
    assert r.status_code == 200
    first: dict[int, dict] = {}
    for event in _sse(r):
        for c in event["choices"]:
            first.setdefault(c["index"], c)
    assert sorted(first) == list(range(6))
    for i, c in first.items():
        ids = prompts[i // 2]
        assert c["text"].startswith(codec.decode(ids))
        lp = c["logprobs"]
        assert len(lp["tokens"]) >= len(ids)
        # the fake engine gives every prompt token but the first a logprob of -1.0
        assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:len(ids)] == [-1.0] * (len(ids) - 1)


def test_stop_string_straddling_min_tokens(stack, codec):
    ids = codec.encode("aaa bbb ccc ddd eee", add_special_tokens=False)
    stop = "bbb ccc"
    # min_tokens ends inside the stop string: it starts before the boundary and completes after it
    k = next(k for k in range(1, len(ids)) if "bb" in codec.decode(ids[:k]))
    assert stop not in codec.decode(ids[:k])
    body = {"model": MODEL, "prompt": ids, "max_tokens": len(ids), "stop": [stop], "min_tokens": k}
    choice = post(stack[1], "/v1/completions", body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("aaa ", "stop", stop)
    events = _sse(post(stack[1], "/v1/completions", {**body, "stream": True}))
    assert "".join(c["text"] for e in events for c in e["choices"]) == "aaa "


def test_detokenize_is_capped(stack):
    r = call(stack[1], "POST", "/detokenize", {"tokens": [5] * (op.MAX_DETOKENIZE_TOKENS + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = call(stack[1], "POST", "/detokenize", {"tokens": [28] * 10_000})  # big: decoded off the event loop
    assert r.status_code == 200 and len(r.json()["prompt"]) >= 10_000


def test_a_full_tokenizer_queue_refuses_big_inputs_at_once(codec):
    gate = threading.Event()

    async def main():
        size = codec.INLINE_CHARS + 1
        blocking = asyncio.ensure_future(codec.run(codec.MAX_QUEUED - size + 1, gate.wait))
        await asyncio.sleep(0.05)
        try:
            with pytest.raises(TokenizerBusy):
                await codec.run(size, len, "x")  # would wait behind the queue: refused instead
            assert await codec.run(10, len, "small") == 5  # small inputs never queue
        finally:
            gate.set()
        await blocking
        return await codec.run(size, len, "x")  # drained: accepted again

    assert asyncio.run(main()) == 1


@pytest.mark.parametrize("key", ["1_0", " 5 ", "\u0663", "-1", "5.0", ""])
def test_logit_bias_keys_are_plain_token_ids(stack, key):
    refused(stack, "/v1/completions", {**CMPL, "logit_bias": {key: 1}}, "logit_bias")
