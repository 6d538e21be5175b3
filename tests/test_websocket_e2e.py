"""/v1/stream against a real ``tokenmill serve`` (tiny random Llama): greedy text equals
/v1/completions, and a cancel frees the request's KV blocks (read with the socket's
own ``stats`` message)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from websockets.asyncio.client import connect

from tests.test_server_e2e import Server


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--max-num-seqs", "8")
    yield s
    s.close()


def test_greedy_parity_and_cancel_frees_blocks(server):
    prompt = "The quick brown fox jumps over the lazy dog because"
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        want = json.loads(r.read())["choices"][0]["text"]

    async def main():
        async with connect(server.url.replace("http", "ws") + "/v1/stream") as ws:
            async def recv():
                return json.loads(await asyncio.wait_for(ws.recv(), 60))

            async def stats():
                await ws.send(json.dumps({"type": "stats", "id": "st"}))
                while (m := await recv())["type"] != "stats":
                    pass
                return m

            before = await stats()
            assert before["num_running"] == 0 and before["num_free_blocks"] == before["num_kv_blocks"]
            await ws.send(json.dumps({"type": "completion", "id": "long", "prompt": "Tell me a very long story",
                                      "max_tokens": 900, "temperature": 0, "ignore_eos": True}))
            await ws.send(json.dumps({"type": "completion", "id": "short", **body}))
            text, deltas, ends = "", 0, {}
            while "short" not in ends:
                m = await recv()
                if m["type"] == "delta" and m["id"] == "short":
                    text += m["text"]
                elif m["type"] == "delta":
                    deltas += 1
                else:
                    ends[m["id"]] = m
            assert text == want and ends["short"]["finish_reason"] == "length"
            assert deltas >= 3
            during = await stats()
            assert during["num_running"] == 1 and during["num_free_blocks"] < during["num_kv_blocks"]
            await ws.send(json.dumps({"type": "cancel", "id": "long"}))
            while (m := await recv())["type"] != "done":
                pass
            assert m["id"] == "long" and m["finish_reason"] == "cancelled"
            deadline = time.monotonic() + 20
            while True:
                after = await stats()
                if after["num_running"] == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert after["num_running"] == 0 and after["num_waiting"] == 0
            assert after["num_free_blocks"] == after["num_kv_blocks"]

    asyncio.run(main())
