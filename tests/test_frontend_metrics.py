"""``/metrics`` and the access log of real frontend processes, against the fake engine.

Two frontends share one port and one multiprocess metrics folder, as under
``tokenmill serve --api-server-count 2``. After a known mix of requests
(finished by length and by a stop token, n=2, streamed chat, one cut by its
client, one past its deadline, one the engine refused, four the frontend
refused), a scrape, whichever frontend answers it, counts every one of them
exactly, parsed with prometheus_client's own parser; every latency histogram
holds one sample per request it applies to. The access log has a line per
request with its id, tokens and finish reason, and no prompt text unless
``log_prompts``. A third frontend serves ``/metrics`` without a key and logs JSON.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import struct
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import Error
from tools.fake_engine import KEY, FakeEngine, free_port, start_frontend, stop_frontend

SECRET = "purple elephants dance"  # a prompt text that must never reach a log unless asked for


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_tokenizer_dir):
    tmp = tmp_path_factory.mktemp("metrics")
    addr = f"ipc://{tmp}/engine.sock"
    engine = FakeEngine(addr, step_delay=0.005)
    engine.start()
    metrics_dir = tmp / "prom"
    metrics_dir.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    port, open_port = free_port(), free_port()
    log, json_log = tmp / "frontends.log", tmp / "open.log"
    cache = str(tmp / "tokenizer")
    procs = []
    with open(log, "w") as err, open(json_log, "w") as jerr:
        for i in range(2):
            procs.append(start_frontend(addr, smollm_tokenizer_dir, port, frontend_id=f"fe-{i}", env=env, stderr=err,
                                        tokenizer_cache_dir=cache))
        procs.append(start_frontend(addr, smollm_tokenizer_dir, open_port, frontend_id="fe-open", stderr=jerr,
                                    tokenizer_cache_dir=cache, metrics_no_auth=True, log_format="json",
                                    log_prompts=True))
    yield engine, port, open_port, log, json_log
    for p in procs:
        assert stop_frontend(p) == 0
    engine.stop()


def call(port: int, method: str, path: str, body=None, key: str | None = KEY, content_type="application/json"):
    """(status, headers, body bytes) over a new connection (so the kernel picks a frontend)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is not None:
        headers["Content-Type"] = content_type
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def frontend_of(request_id: str) -> str:
    """The per-process part of an id (``req-<8 hex>...``, ``cmpl-<8 hex>...``): which frontend answered."""
    return request_id.split("-")[1][:8]


def scrape(port: int, key: str | None = KEY) -> tuple[dict, str]:
    """({(name, labels...): value}, the frontend that answered)."""
    status, headers, body = call(port, "GET", "/metrics", key=key)
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, *labels)] = s.value
            if fam.name.startswith("tokenmill:") and "model_name" in s.labels:
                assert s.labels["model_name"] == "smol" and s.labels["engine"] == "0"
    return out, frontend_of(headers["x-request-id"])


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, *sorted(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def log_lines(path) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def access_line(path, request_id: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        found = [ln for ln in log_lines(path) if "tokenmill.access" in ln and f"request_id={request_id} " in ln]
        if found:
            assert len(found) == 1
            return found[0]
        assert time.monotonic() < deadline, f"no access line for {request_id}"
        time.sleep(0.05)


def fields(line: str) -> dict:
    return dict(part.split("=", 1) for part in line.split(": ", 1)[1].split(" "))


def ids(n: int, base: int) -> list[int]:
    return list(range(base, base + n))


def stream_and_hang_up(port: int, body: dict) -> str:
    """Start a streamed completion, read its first event, go away; the call's request id."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(data), data))
    got = b""
    while b"data: " not in got:
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    s.close()
    return next(line.split(":", 1)[1].strip() for line in got.decode().split("\r\n")
                if line.lower().startswith("x-request-id:"))


def test_metrics_count_a_known_mix_exactly_across_two_frontends(stack):
    engine, port, _, log, _ = stack
    before, _ = scrape(port)
    # both frontends answer (SO_REUSEPORT picks one per connection): /v1/models until each has
    seen, models = set(), 0
    while len(seen) < 2:
        status, headers, _ = call(port, "GET", "/v1/models")
        assert status == 200 and models < 200
        seen.add(frontend_of(headers["x-request-id"]))
        models += 1

    def complete(body, want=200):
        status, headers, raw = call(port, "POST", "/v1/completions", {"model": "smol", **body})
        assert status == want, raw
        return headers["x-request-id"], json.loads(raw)

    p40 = ids(40, 1000)  # two blocks of 16 come from the prefix cache the second time
    rid_len, r = complete({"prompt": p40, "max_tokens": 4})
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, r = complete({"prompt": p40, "max_tokens": 4})
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    rid_stop, r = complete({"prompt": ids(6, 2000), "max_tokens": 10, "stop_token_ids": [2002]})
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 3
    _, r = complete({"prompt": ids(5, 3000), "max_tokens": 3, "n": 2})
    assert [c["finish_reason"] for c in r["choices"]] == ["length", "length"]
    status, headers, raw = call(port, "POST", "/v1/chat/completions", {
        "model": "smol", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    usage = [json.loads(ev[6:]) for ev in raw.decode().split("\n\n") if ev.startswith("data: {")][-1]["usage"]
    chat_prompt, chat_id = usage["prompt_tokens"], headers["x-request-id"]
    rid_cut = stream_and_hang_up(port, {"model": "smol", "prompt": ids(8, 4000), "max_tokens": 400, "stream": True})
    rid_timeout, _ = complete({"prompt": ids(4, 5000), "max_tokens": 50, "timeout": 1e-6}, want=408)
    engine.refuse = Error(None, 429, "rate_limit_error", "the queue is full")
    try:
        rid_refused, _ = complete({"prompt": ids(3, 6000), "max_tokens": 5}, want=429)
    finally:
        engine.refuse = None
    assert complete({"prompt": ids(3, 7000), "max_tokens": -1}, want=400)[0].startswith("req-")
    assert call(port, "POST", "/v1/completions", {"model": "smol", "prompt": "x"}, key=None)[0] == 401
    assert call(port, "POST", "/v1/completions", {"model": "smol", "prompt": "x"}, content_type="text/plain")[0] == 415
    assert call(port, "GET", "/nope")[0] == 404
    assert call(port, "GET", "/v1/models/smol")[0] == 200 and call(port, "GET", "/v1/models/other")[0] == 404
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # refused by the HTTP layer, no method
        raw.sendall(b"GARBAGE\r\n\r\n")
        assert raw.recv(4096).startswith(b"HTTP/1.1 400")

    cut_line = access_line(log, rid_cut)  # logged once its frontend saw the client go
    cut = fields(cut_line)
    assert cut["status"] == "200" and cut["finish_reason"] == "abort" and f"{rid_cut}-0" in engine.aborts
    cut_tokens = int(cut["generation_tokens"])
    assert 1 <= cut_tokens < 400

    # whichever frontend answers, the numbers are the same: scrape until both have, once the engine
    # gauges come from a STATS sent after the cut stream's abort (each frontend asks every 2 s); one from
    # before the workload says 0 running too, and the workload can take less than a ping's 2 s: its hit
    # rate tells them apart (the fake engine's, now)
    scrapes, deadline = {}, time.monotonic() + 15
    while len(scrapes) < 2 and time.monotonic() < deadline:
        after, fe = scrape(port)
        if after[("tokenmill:num_requests_running",)] != 0 or (
                after[("tokenmill:prefix_cache_hit_rate",)] != engine.prefix_cache.hit_rate):
            scrapes.clear()
            time.sleep(0.1)
            continue
        scrapes.setdefault(fe, after)
    assert set(scrapes) == seen
    (fe_a, a), (fe_b, b) = scrapes.items()
    metrics_key = ("tokenmill:http_requests_total", ("handler", "/metrics"), ("method", "GET"), ("status", "2xx"))
    assert {k: v for k, v in a.items() if k != metrics_key} == {k: v for k, v in b.items() if k != metrics_key}
    after = a

    def d(name, **labels):
        return delta(after, before, name, **labels)

    reasons = {r: d("tokenmill:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort", "timeout", "error")}
    # the refused one (a 429: the engine's queue full) was no engine request: counted by its HTTP status only
    assert reasons == {"stop": 1, "length": 5, "abort": 1, "timeout": 1, "error": 0}
    engine_requests = 8
    assert d("tokenmill:prompt_tokens_total") == 40 + 40 + 6 + 5 + 5 + chat_prompt + 8 + 4
    assert d("tokenmill:prefix_cache_queries_total") == d("tokenmill:prompt_tokens_total")
    assert d("tokenmill:prompt_tokens_cached_total") == d("tokenmill:prefix_cache_hits_total") == 32
    generated = 4 + 4 + 3 + 3 + 3 + 3 + cut_tokens
    assert d("tokenmill:generation_tokens_total") == generated
    # one sample per engine request in the per-request histograms, whatever ended it
    for h in ("e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert d(f"tokenmill:{h}_count") == engine_requests, h
    assert d("tokenmill:request_prompt_tokens_sum") == d("tokenmill:prompt_tokens_total")
    assert d("tokenmill:request_generation_tokens_sum") == generated
    with_tokens = 7  # all but the timed-out and the refused one
    assert d("tokenmill:time_to_first_token_seconds_count") == with_tokens
    assert d("tokenmill:inter_token_latency_seconds_count") == generated - with_tokens
    assert d("tokenmill:request_decode_time_seconds_count") == with_tokens
    # per request with two tokens or more: all with tokens, the cut one perhaps not
    assert d("tokenmill:request_time_per_output_token_seconds_count") == with_tokens - (cut_tokens < 2)
    answered = 8  # the engine answered every one it took
    for h in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_inference_time_seconds"):
        assert d(f"tokenmill:{h}_count") == answered, h
    assert d("tokenmill:e2e_request_latency_seconds_bucket", le="+Inf") == engine_requests
    assert d("tokenmill:time_to_first_token_seconds_sum") > 0
    # responses by handler and status class: 499 never happened, the cut stream had its 200
    http = {(k[1][1], k[2][1], k[3][1]): v - before.get(k, 0.0) for k, v in after.items()
            if k[0] == "tokenmill:http_requests_total"}
    assert {k: v for k, v in http.items() if v} == {
        ("/v1/models", "GET", "2xx"): models,
        ("/v1/completions", "POST", "2xx"): 5,
        ("/v1/completions", "POST", "4xx"): 5,  # 408, 429, 400, 401, 415
        ("/v1/chat/completions", "POST", "2xx"): 1,
        ("unmatched", "GET", "4xx"): 1,
        ("unmatched", "-", "4xx"): 1,  # (the HTTP layer's refusals counted too: review AB)
        ("/v1/models/{model}", "GET", "2xx"): 1,  # (one name for every model's card: a bounded set)
        ("/v1/models/{model}", "GET", "4xx"): 1,
        ("/metrics", "GET", "2xx"): http[("/metrics", "GET", "2xx")],
    }
    assert http[("/metrics", "GET", "2xx")] >= 1
    # engine gauges from the latest STATS, not one per frontend
    assert after[("tokenmill:kv_cache_usage_perc",)] == 0.1
    assert after[("tokenmill:num_requests_running",)] == 0
    assert after[("tokenmill:num_preemptions_total",)] == 0

    # the access log: one line per request, its numbers, never the prompt
    f = fields(access_line(log, rid_len))
    assert (f["method"], f["endpoint"], f["status"], f["prompt_tokens"], f["cached_tokens"],
            f["generation_tokens"], f["finish_reason"]) == ("POST", "/v1/completions", "200", "40", "0", "4", "length")
    assert 0 < float(f["ttft_s"]) <= float(f["total_s"]) < 30 and f["client"].startswith("127.0.0.1:")
    assert fields(access_line(log, rid_stop))["finish_reason"] == "stop"
    assert fields(access_line(log, chat_id))["prompt_tokens"] == str(chat_prompt)
    timeout_line = fields(access_line(log, rid_timeout))
    assert (timeout_line["status"], timeout_line["finish_reason"], timeout_line["ttft_s"]) == ("408", "timeout", "-")
    assert fields(access_line(log, rid_refused))["finish_reason"] == "error"
    refused = [ln for ln in log_lines(log) if "tokenmill.access" in ln and " status=401 " in ln]
    assert refused and "generation_tokens" not in refused[-1]
    text = open(log).read()
    assert SECRET not in text and "purple" not in text


def test_metrics_need_the_key_unless_opened(stack):
    _, port, open_port, _, json_log = stack
    status, headers, body = call(port, "GET", "/metrics", key=None)
    assert status == 401 and b"invalid_api_key" in body and headers["x-request-id"].startswith("req-")
    assert call(port, "GET", "/metrics", key="wrong")[0] == 401
    assert call(port, "GET", "/health", key=None)[0] == 200
    # --metrics-no-auth opens /metrics only
    assert call(open_port, "GET", "/v1/models", key=None)[0] == 401
    scraped, _ = scrape(open_port, key=None)
    assert ("tokenmill:num_requests_running",) in scraped


def test_json_access_log_with_prompts(stack):
    _, _, open_port, _, json_log = stack
    status, headers, raw = call(open_port, "POST", "/v1/completions",
                                {"model": "smol", "prompt": SECRET, "max_tokens": 2})
    assert status == 200
    rid = headers["x-request-id"]
    assert rid == json.loads(raw)["id"]  # the header names the call by its own id
    deadline = time.monotonic() + 10
    while True:
        entries = [json.loads(ln) for ln in log_lines(json_log) if ln.startswith("{")]
        mine = [e for e in entries if e.get("request_id") == rid]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (e,) = mine
    assert e["logger"] == "tokenmill.access" and e["level"] == "INFO"
    assert (e["endpoint"], e["status"], e["generation_tokens"], e["finish_reason"]) == (
        "/v1/completions", 200, 2, "length")
    assert e["prompt"] == SECRET  # --log-prompts
    assert isinstance(e["ttft_s"], float) and e["total_s"] >= e["ttft_s"]
    assert all(isinstance(x, dict) for x in entries)  # every line of that frontend is JSON
    assert any(x.get("message", "").startswith("frontend fe-open serving") for x in entries)
    # scrapes and probes are not logged at INFO
    call(open_port, "GET", "/health")
    call(open_port, "GET", "/metrics")
    time.sleep(0.2)
    assert not [x for x in (json.loads(ln) for ln in log_lines(json_log)) if x.get("endpoint") in ("/health", "/metrics")]
    # a WebSocket generation gets its own line
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{open_port}/v1/stream", additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "completion", "id": "w1", "prompt": [5, 6, 7], "max_tokens": 3}))
        while json.loads(ws.recv())["type"] != "done":
            pass
    deadline = time.monotonic() + 10
    while not (ws_lines := [x for x in (json.loads(ln) for ln in log_lines(json_log)) if x.get("method") == "WS"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (w,) = ws_lines
    assert (w["endpoint"], w["status"], w["generation_tokens"], w["finish_reason"]) == ("/v1/stream", 200, 3, "length")
    assert w["request_id"].startswith("cmpl-") and w["client"].startswith("127.0.0.1:")
    # one whose client resets in the middle of it keeps the client's address, taken as the socket connected
    first = None
    with contextlib.suppress(OSError, ConnectionClosed), connect(  # (the client's own close, on the reset socket)
            f"ws://127.0.0.1:{open_port}/v1/stream", additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        address = "{}:{}".format(*ws.socket.getsockname())
        ws.send(json.dumps({"type": "completion", "id": "w2", "prompt": [5, 6, 7], "max_tokens": 200}))
        first = json.loads(ws.recv())["type"]
        ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ws.socket.close()
    assert first == "delta"
    deadline = time.monotonic() + 10
    while len(ws_lines := [x for x in (json.loads(ln) for ln in log_lines(json_log)) if x.get("method") == "WS"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ws_lines[1]["client"] == address


def test_a_request_reset_before_its_answer_is_logged_499(stack):
    """A client that resets its connection (RST) right after its request: the access log has its line, 499
    (uvloop's transport, closed by then, raised when asked for the client's address, and the observer's error
    kept the line from the log). The address is the one taken as the connection was made: "-" where the reset
    came before the server took the connection."""
    _, _, open_port, _, json_log = stack
    body = json.dumps({"model": "smol", "prompt": "reset me " + SECRET, "max_tokens": 200}).encode()
    s = socket.create_connection(("127.0.0.1", open_port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    address = "{}:{}".format(*s.getsockname())
    s.close()
    deadline = time.monotonic() + 10
    while not (mine := [e for e in (json.loads(ln) for ln in log_lines(json_log) if ln.startswith("{"))
                        if e.get("prompt") == "reset me " + SECRET]):
        assert time.monotonic() < deadline, "the reset request was never logged (its observer failed)"
        time.sleep(0.05)
    assert [e["status"] for e in mine] == [499] and mine[0]["client"] in (address, "-")
    assert not [ln for ln in log_lines(json_log) if "observer failed" in ln]
