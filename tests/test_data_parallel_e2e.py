"""``tokenmill serve -dp 2`` and ``tokenmill engine --listen tcp://`` as real processes, on the tiny model.

Fast router and CURVE checks over fake engines are in ``tests/test_data_parallel.py``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import signal
import subprocess
import tempfile
import time

import pytest

from tests.test_server_e2e import CMD, ROOT, Server, free_port, http_status, pid_alive, wait_for

KEY = "e2e-engine-key-0123456789abcdef"


def post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def get_json(url: str) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/" + url.split("/", 3)[3])
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def open_streams(url: str, prompts: list[str], max_tokens: int) -> list[http.client.HTTPConnection]:
    """Streaming completions whose first events have arrived (so the engines are running them), all sent
    before any is read: on a fast engine the first could end while later ones are still being opened."""
    host, port = url.removeprefix("http://").split(":")
    conns = []
    for prompt in prompts:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        conns.append(conn)
    for conn in conns:
        r = conn.getresponse()
        assert r.status == 200
        assert r.read1(65536).startswith(b"data:")
    return conns


@pytest.fixture(scope="module")
def dp_server(tiny_llama):
    s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--data-parallel-size", "2",
               "--device", "cpu", "--kv-cache-memory", "64M", api_server_count=2)
    yield s
    s.close()


def test_dp2_two_frontends_spread_concurrent_requests_over_both_engines(dp_server):
    s = dp_server
    assert s.banner == f"tokenmill serving tiny on {s.url} (2 frontends, 2 engines)"
    status, health = get_json(s.url + "/health")
    assert status == 200 and health["status"] == "ok"
    assert [e["status"] for e in health["engines"]] == ["ok", "ok"]
    # long streams (900 tokens, the first one read): both engines must be running some while they last
    streams = open_streams(s.url, [f"Request number {i} says" for i in range(6)], 900)
    try:
        load = [st.num_running + st.num_waiting
                for st in (s.engine_stats("engine.sock"), s.engine_stats("engine-1.sock"))]
        assert all(n >= 1 for n in load) and sum(load) >= 6 - 1, load  # (one may have just ended)
    finally:
        for c in streams:
            c.close()  # the frontends abort them in their engine
    wait_for(lambda: all(st.num_running + st.num_waiting == 0 for st in
                         (s.engine_stats("engine.sock"), s.engine_stats("engine-1.sock"))), 30, "aborts")
    # every one of several concurrent plain requests is answered, n = 2 included
    for i in range(4):
        status, body = post(s.url, {"model": "tiny", "prompt": f"Hi {i}", "max_tokens": 5, "n": 2,
                                    "temperature": 0, "ignore_eos": True})
        assert status == 200 and [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
        assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy, the same engine
    # per-engine gauges carry the engine's index
    wait_for(lambda: b'engine="1"' in _metrics(s.url), 10, "engine 1's gauges")


def _metrics(url: str) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read()
    finally:
        conn.close()


def _engine_gauge(url: str, name: str, engine: str) -> float:
    m = re.search(rf'tokenmill:{name}{{[^}}]*engine="{engine}"[^}}]*}} (\S+)'.encode(), _metrics(url))
    return float(m.group(1)) if m else -1.0


def test_dp2_a_dead_engine_leaves_the_other_serving_and_health_degraded(dp_server):
    s = dp_server
    victim = s.pids("tokenmill-engine-1")[-1]
    streams = open_streams(s.url, [f"Busy {i} says" for i in range(6)], 900)  # both engines running some
    try:
        wait_for(lambda: _engine_gauge(s.url, "num_requests_running", "1") >= 1, 10, "engine 1's running gauge")
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: get_json(s.url + "/health")[1].get("status") == "degraded", 15, "degraded health")
    finally:
        for c in streams:
            c.close()
    # its requests failed: its load gauges fall to 0 (they stayed at its last numbers, for good)
    wait_for(lambda: all(_engine_gauge(s.url, g, "1") == 0 for g in ("num_requests_running", "num_requests_waiting",
                                                                     "kv_cache_usage_perc")), 15, "engine 1 at 0")
    status, health = get_json(s.url + "/health")
    assert status == 200
    assert [e["status"] for e in health["engines"]] == ["ok", "unavailable"]
    for i in range(4):  # new requests all go to engine 0
        status, body = post(s.url, {"model": "tiny", "prompt": f"Still here {i}", "max_tokens": 4,
                                    "temperature": 0})
        assert status == 200, body
    assert s.proc.poll() is None  # the launcher serves on
    # (the launcher notices the death on its own poll, which may come after the frontends' health check)
    wait_for(lambda: "serving on with 1 of 2 engines" in s.log(), 15, "the launcher's notice", 0.2)
    # a frontend that dies now comes back without waiting for the dead engine
    os.kill(s.pids("tokenmill-frontend-0")[-1], signal.SIGKILL)
    wait_for(lambda: "tokenmill-frontend-0 is ready again" in s.log(), 60, "the frontend's restart", 0.2)
    for i in range(4):
        status, body = post(s.url, {"model": "tiny", "prompt": f"Again {i}", "max_tokens": 4, "temperature": 0})
        assert status == 200, body
    # the last engine gone: 503, and the launcher exits non-zero
    os.kill(s.pids("tokenmill-engine-0")[-1], signal.SIGKILL)
    wait_for(lambda: http_status(s.url + "/health") in (503, None), 15, "health 503")
    assert s.proc.wait(30) == 1


# ----------------------------------------------------------------------------- remote engine


class RemoteEngine:
    """``tokenmill engine --listen tcp://127.0.0.1:PORT`` as a subprocess."""

    def __init__(self, model: str, key: str):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, TOKENMILL_ENGINE_KEY=key, PYTHONUNBUFFERED="1")
        self.log_file = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([*CMD, "engine", "--model", model, "--served-model-name", "tiny",
                                      "--device", "cpu", "--kv-cache-memory", "64M", "--listen", self.address],
                                     stdout=subprocess.PIPE, stderr=self.log_file, text=True, env=env, cwd=ROOT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], 0.5)[0]:  # stdout has the one banner line
                self.banner = self.proc.stdout.readline().strip()
                return
        self.close()
        raise AssertionError("remote engine did not start:\n" + self.output)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log_file.seek(0)
        self.output = self.log_file.read()
        self.log_file.close()


def test_frontends_serve_with_a_headless_engine_over_tcp(tiny_llama):
    engine = RemoteEngine(tiny_llama, KEY)
    try:
        assert engine.banner == f"tokenmill engine serving tiny on {engine.address} (1 rank, CURVE)"
        s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--engine", engine.address,
                   "--engine-key", KEY, startup=120)
        try:
            assert s.banner == f"tokenmill serving tiny on {s.url} (1 frontend, 1 remote engine)"
            assert not s.pids("tokenmill-engine")  # no local engine
            status, body = post(s.url, {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0,
                                        "ignore_eos": True})
            assert status == 200 and body["usage"]["completion_tokens"] == 5
        finally:
            s.close()
        # a frontend with the wrong key never gets in: start-up fails with the reason
        bad = subprocess.run([*CMD, "serve", "--model", tiny_llama, "--engine", engine.address, "--engine-key",
                              "not-the-key-0123456789", "--port", str(free_port()), "--startup-timeout", "3"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120,
                             env=dict(os.environ, TOKENMILL_LOG_LEVEL="INFO"))
        assert bad.returncode == 1
        assert "is --engine-key theirs?" in bad.stderr
        assert engine.proc.poll() is None
    finally:
        engine.close()
    assert engine.proc.returncode == 0
    # (a wrong key gives a wrong engine public key too: the CURVE handshake fails before any HELLO is read)
    assert engine.output.count("connected") == 1, engine.output


def test_tcp_engine_and_remote_serve_refuse_to_run_without_a_key(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_ENGINE_KEY"}
    r = subprocess.run([*CMD, "engine", "--model", tiny_llama, "--listen", f"tcp://127.0.0.1:{free_port()}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert r.returncode == 2 and "needs --engine-key" in r.stderr
    r = subprocess.run([*CMD, "serve", "--model", tiny_llama, "--engine", "tcp://127.0.0.1:1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert r.returncode == 2 and "needs the engine's key" in r.stderr
    r = subprocess.run([*CMD, "serve", "--model", tiny_llama, "-dp", "2", "--engine", "tcp://127.0.0.1:1",
                        "--engine-key", KEY], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert r.returncode == 2 and "--data-parallel-size" in r.stderr
    assert not pid_alive(r.returncode + 10**7)  # (nothing was left running: no pid of ours to find)
