"""A request the engine could not run (finish reason "error": out of memory) fails as in vLLM.

Over HTTP a 500 with an OpenAI error body (an error event that ends the stream once
it has begun), over WebSocket an ``error`` message; no client is shown "error" as a
finish reason, the metrics count it as one, and the next request is served as usual.
The fake engine of ``tools/fake_engine.py`` ends every request with an empty
"error" delta once it has ``fail_after`` tokens.
"""

from __future__ import annotations

import json

import openai
import pytest
from websockets.asyncio.client import connect

from frontends.text import TextCodec
from frontends.tokenizer import load_tokenizer
from tests import test_frontend_scheduling
from tests.test_frontend_metrics import delta, scrape
from tests.test_frontend_scheduling import CHAT, post_raw, sse_events
from tests.test_websocket import AUTH, recv, run, serving
from tools.fake_engine import KEY, MODEL

ENDPOINTS = [("/v1/completions", {"prompt": "hello world", "max_tokens": 5}),
             ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5})]


# the scheduling tests' fake engine and frontend, one of each for this module
engine, port = test_frontend_scheduling.engine, test_frontend_scheduling.port


@pytest.fixture(autouse=True)
def _reset_engine(engine):
    yield
    engine.fail_after = None
    engine.step_delay = 0.0


def paced(engine) -> None:
    """A step every 50 ms: the tokens before a failure reach the frontend before it does (tokens that
    come in one batch with the failure are dropped with the call)."""
    engine.step_delay = 0.05


def assert_engine_error(error: dict) -> None:
    """``code``: the status, in an HTTP body as in an event or message (as every unnamed ApiError's)."""
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("internal_server_error", 500)
    assert "could not run this request (out of memory)" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
def test_an_engine_error_before_any_token_is_500_then_the_next_works(engine, port, path, body, stream):
    before, _ = scrape(port)
    engine.fail_after = 0
    status, headers, raw = post_raw(port, path, {**body, "n": 2, "stream": stream})
    assert status == 500 and headers["content-type"] == "application/json", raw
    assert headers["x-should-retry"] == "false"  # it would only fail again
    assert_engine_error(json.loads(raw)["error"])
    engine.fail_after = None
    status, _, raw = post_raw(port, path, body)
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"
    after, _ = scrape(port)
    counted = {r: delta(after, before, "tokenmill:request_success_total", finished_reason=r)
               for r in ("error", "abort", "length")}
    # the second choice fails too, unless the first one's failure aborted it before its first step
    assert counted["error"] >= 1 and counted["error"] + counted["abort"] == 2 and counted["length"] == 1


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
def test_an_engine_error_mid_stream_is_an_error_event_that_ends_the_stream(engine, port, path, body):
    paced(engine)
    engine.fail_after = 2
    status, _, raw = post_raw(port, path, {**body, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert_engine_error(events[-2]["error"])
    chunks = events[:-2]
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks if c["choices"])
    engine.fail_after = None
    status, _, raw = post_raw(port, path, {**body, "stream": True})
    assert status == 200 and sse_events(raw)[-2]["choices"][0]["finish_reason"] == "length"


def test_the_openai_client_sees_an_internal_server_error(engine, port):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=2)
    engine.fail_after = 0
    adds = len(engine.adds)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5)
    assert e.value.status_code == 500 and "out of memory" in e.value.message
    assert len(engine.adds) == adds + 1  # not retried
    paced(engine)
    engine.fail_after = 3
    with pytest.raises(openai.APIError, match="out of memory"):
        for _ in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, stream=True):
            pass


def test_websocket_error_message_then_the_next_generation_works(engine, smollm_tokenizer_dir):
    codec = TextCodec(load_tokenizer(smollm_tokenizer_dir))

    paced(engine)

    async def main():
        async with serving(engine, codec) as s, connect(s.url, additional_headers=AUTH) as ws:
            ends = []
            for gid, fail_after in (("a", 0), ("b", 2), ("c", None)):
                engine.fail_after = fail_after
                msg = {"type": "completion", "id": gid, "prompt": [5, 6, 7], "max_tokens": 5}
                await ws.send(json.dumps(msg))
                deltas = 0
                while (m := await recv(ws))["type"] == "delta":
                    deltas += 1
                ends.append((m["id"], m["type"], deltas, m))
            return ends

    (a, b, c) = run(main())
    assert a[:3] == ("a", "error", 0) and b[:3] == ("b", "error", 2)
    for end in (a, b):
        assert_engine_error(end[3]["error"])
    assert c[:3] == ("c", "done", 5) and c[3]["finish_reason"] == "length"
