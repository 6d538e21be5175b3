"""``tools/bench_frontend.py``'s requests and flags (its served run is the tool's own: it times, never tested)."""

from __future__ import annotations

import json

import pytest

from tools.bench_frontend import parse_args, request_bytes


def _body(request: bytes) -> dict:
    return json.loads(request.split(b"\r\n\r\n", 1)[1])


def test_streams_ask_for_logprobs_in_each_apis_words():
    assert _body(request_bytes(4, 8, "completions", 5))["logprobs"] == 5
    chat = _body(request_bytes(4, 8, "chat", 20))
    assert (chat["logprobs"], chat["top_logprobs"], chat["max_tokens"]) == (True, 20, 8)
    assert "logprobs" not in _body(request_bytes(4, 8, "chat"))
    assert parse_args(["--endpoint", "chat", "--logprobs", "20", "--max-tokens", "100"]).logprobs == 20
    with pytest.raises(SystemExit):
        parse_args(["--endpoint", "responses", "--logprobs", "5", "--max-tokens", "100"])
