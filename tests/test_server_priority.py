"""Priority scheduling end to end: real ``tokenmill serve`` processes and the ``openai`` client.

A saturated server (``--max-num-seqs 2``, eight long low-priority streams): an
urgent request sent into it gets its first token before every low-priority
request that was still waiting, and the low-priority streams, some of them
preempted for it, still complete with the text they have when run alone.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.test_server_e2e import Server, openai_client

LOW, URGENT = 5, -1
LONG_TOKENS = 64
PROMPTS = [f"Story number {i}: once upon a time" for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_llama):
    # float32: a CPU with native bf16 (AVX512-BF16, AMX) runs "auto" in bf16, whose GEMMs round differently
    # by batch size: random weights' near-ties then flip with the batch (token 16 of story 5, 2 runs in 3)
    s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--max-num-seqs", "2",
               "--scheduling-policy", "priority", "--dtype", "float32")
    yield s
    s.close()


def stream(client, prompt: str, priority: int, max_tokens: int, out: dict) -> None:
    """One streaming completion; records when its first text arrived and the whole text."""
    pieces = []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"priority": priority, "ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            out.setdefault("first", time.monotonic())
            pieces.append(chunk.choices[0].text)
        if chunk.choices and chunk.choices[0].finish_reason:
            out["finish_reason"] = chunk.choices[0].finish_reason
    out["text"] = "".join(pieces)


@pytest.fixture(scope="module")
def alone(tiny_llama):
    """Greedy texts with nothing to preempt them (offline, batched: batching never changes greedy output)."""
    from engine import LLM, SamplingParams

    outs = LLM(tiny_llama, dtype="float32").generate(PROMPTS, SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True))
    return [o.text for o in outs]


def test_urgent_request_overtakes_waiting_low_priority_ones(server, alone):
    client = openai_client(server)
    low = [{} for _ in PROMPTS]
    threads = [threading.Thread(target=stream, args=(client, p, LOW, LONG_TOKENS, o), daemon=True)
               for p, o in zip(PROMPTS, low, strict=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum("first" in o for o in low) < 2:  # the two seats are taken; six wait
        assert time.monotonic() < deadline, "no low-priority stream started"
        time.sleep(0.005)
    waiting = [i for i, o in enumerate(low) if "first" not in o]
    assert len(waiting) >= 4, "the server was not saturated: the test proves nothing"
    urgent: dict = {}
    stream(client, "An urgent question:", URGENT, 8, urgent)
    for t in threads:
        t.join(120)
    assert all("text" in o for o in low), "a low-priority stream did not complete"
    late = [i for i in waiting if low[i]["first"] < urgent["first"]]
    assert not late, f"low-priority requests {late} that were waiting got their first token before the urgent one"
    assert server.engine_stats().num_preemptions >= 1  # a seat was taken from a running low-priority stream
    assert [(o["text"], o["finish_reason"]) for o in low] == [(text, "length") for text in alone]
