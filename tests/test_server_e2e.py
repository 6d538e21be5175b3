"""``tokenmill serve`` end to end: a real launcher, engine and two frontends.

One server per module (a tiny random Llama, ``--api-server-count 2``), driven
with the official ``openai`` client: concurrent clients, greedy parity with the
offline ``LLM``, a client disconnect freeing KV blocks (read with a STATS frame
on the engine's socket), ``/metrics`` and the access log, a killed frontend
being replaced while the other keeps serving, and SIGTERM exiting 0 with the
runtime dir gone (last: it ends the server).

``Server`` is also used by ``test_server_default_model.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import zmq

from engine import protocol as p

BIN = os.path.join(os.path.dirname(sys.executable), "tokenmill")
CMD = [BIN] if os.path.exists(BIN) else [sys.executable, "-m", "engine.cli"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def http_status(url: str, timeout: float = 10.0) -> int | None:
    """The HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_for(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Server:
    """``tokenmill serve`` as a subprocess; knows its URL, runtime dir and child pids (from the log)."""

    def __init__(self, *args: str, api_server_count: int = 1, startup: float = 300.0, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-test-", suffix=".log", delete=False)
        env = dict(os.environ, TOKENMILL_LOG_LEVEL="INFO", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [*CMD, "serve", *args, "--port", str(self.port), "--api-server-count", str(api_server_count)],
            stdout=subprocess.PIPE, stderr=self.log_file, text=True, env=env, cwd=ROOT)
        self.banner = self._read_banner(startup)

    def _read_banner(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                line = self.proc.stdout.readline()
                if line:
                    return line.strip()
            if self.proc.poll() is not None:
                break
        self.kill()
        raise AssertionError(f"server did not start (rc={self.proc.returncode}):\n{self.log()[-6000:]}")

    def log(self) -> str:
        with open(self.log_file.name) as f:
            return f.read()

    @property
    def runtime_dir(self) -> str:
        return re.search(r"runtime dir (\S+)", self.log()).group(1)

    def pids(self, name: str) -> list[int]:
        """Every pid a child called ``name`` ever had, oldest first."""
        return [int(x) for x in re.findall(rf"started {re.escape(name)} \(pid (\d+)\)", self.log())]

    def engine_stats(self, socket_name: str = "engine.sock") -> p.Stats:
        """STATS of a local engine (data parallel: ``engine-1.sock`` ... for the others)."""
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, b"test-probe")
        try:
            s.connect(f"ipc://{self.runtime_dir}/{socket_name}")
            s.send(msgpack.packb([int(p.Kind.STATS), []]))
            assert s.poll(10_000), "no STATS reply from the engine"
            return p.decode(s.recv())
        finally:
            s.close()
            ctx.term()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        # children die with the launcher (PDEATHSIG); make sure in case they did not
        for name in ("tokenmill-engine", *(f"tokenmill-engine-{i}" for i in range(8)),
                     *(f"tokenmill-frontend-{i}" for i in range(8))):
            for pid in self.pids(name) if os.path.exists(self.log_file.name) else []:
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        self.kill()
        self.proc.stdout.close()
        self.log_file.close()
        os.unlink(self.log_file.name)


def openai_client(server: Server, **kw):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120, **kw)


PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog because",
    "In a hole in the ground there lived",
]
MAX_TOKENS = 12
WRITE_TIMEOUT = 2.0  # seconds a client may read nothing of a full stream before it is cut off


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--max-num-seqs", "16",
               "--write-timeout", str(WRITE_TIMEOUT), "--socket-send-buffer", "64K", api_server_count=2,
               env={"VLLM_SERVER_DEV_MODE": "1"})  # (vLLM's /reset_prefix_cache)
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """Greedy offline outputs, one prompt at a time (no batching effects)."""
    from engine import LLM, SamplingParams

    llm = LLM(tiny_llama)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {prompt: llm.generate([prompt], params)[0] for prompt in PROMPTS}


def test_banner_models_and_health(server):
    assert server.banner == f"tokenmill serving tiny on {server.url} (2 frontends)"
    assert http_status(server.url + "/health") == 200
    models = openai_client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert oct(os.stat(server.runtime_dir).st_mode & 0o777) == "0o700"


def test_greedy_matches_offline_llm(server, offline):
    client = openai_client(server)
    for prompt in PROMPTS:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        want = offline[prompt]
        assert r.choices[0].text == want.text, prompt
        assert r.usage.completion_tokens == len(want.token_ids) == MAX_TOKENS
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.choices[0].finish_reason == "length"


def test_completion_logprobs_always_give_the_sampled_tokens(server):
    """OpenAI's legacy logprobs: "the logprob of the sampled token, so there may be up to logprobs+1 elements", as
    vLLM gives them; the echoed prompt's tokens too. At temperature 2 a random model seldom samples its likeliest."""
    client = openai_client(server)
    for k in (0, 1):
        r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=2.0, seed=1,
                                      logprobs=k, echo=True, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        assert lp.top_logprobs[0] is None and len(lp.tokens) > 9
        for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert top[token] == logprob and len(top) <= k + 1
        assert k == 0 or any(len(top) == 2 for top in lp.top_logprobs[1:])


def test_concurrent_streaming_clients(server, offline):
    from openai import AsyncOpenAI

    async def one(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        return prompt, text, finish

    async def main():
        # separate clients: separate connection pools, spread over both frontends
        clients = [AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
                   for _ in range(4)]
        jobs = [one(clients[i % 4], PROMPTS[i % len(PROMPTS)]) for i in range(16)]
        try:
            return await asyncio.gather(*jobs)
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    assert len(results) == 16
    for prompt, text, finish in results:
        assert finish == "length"
        assert text == offline[prompt].text, prompt


def test_a_shared_system_prompt_is_served_from_the_prefix_cache(server, tiny_llama):
    from transformers import AutoTokenizer

    system = "You are a careful assistant who answers in one short sentence. " * 8
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is the capital of France?", "Name a color.")]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False) for c in chats]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    assert shared > 64  # the system prompt spans several blocks of 16
    client = openai_client(server)
    first, second = (client.chat.completions.create(model="tiny", messages=c, max_tokens=4, temperature=0)
                     for c in chats)
    assert first.usage.prompt_tokens == len(ids[0]) and second.usage.prompt_tokens == len(ids[1])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= shared // 16 * 16
    # streamed, with usage: the whole first chat is cached by now (all but its last block's tokens)
    stream = client.chat.completions.create(model="tiny", messages=chats[0], max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == first.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens == (len(ids[0]) - 1) // 16 * 16
    # /health shows the stats the frontends' liveness pings (every 2 s) last brought
    health = wait_for(lambda: (h := json.loads(urllib.request.urlopen(server.url + "/health", timeout=10).read()))
                      .get("prefix_cache_hit_rate", 0) > 0 and h["num_free_blocks"] == h["num_kv_blocks"] and h,
                      15, "/health to show prefix-cache hits, the requests done")
    assert 0 < health["prefix_cache_hit_rate"] < 1 and health["num_evictions"] == 0
    # (and every block free: cached ones count as free)
    # vLLM's POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1): refused while a request runs, then done
    running = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=200, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True})
    next(iter(running))
    status, body = _post(server.url + "/reset_prefix_cache")
    assert status == 409 and "running requests hold cached blocks" in json.loads(body)["error"]["message"]
    running.close()
    status, body = _post(server.url + "/reset_prefix_cache?reset_running_requests=true")
    assert status == 400 and json.loads(body)["error"]["param"] == "reset_running_requests"
    status, body = _post(server.url + "/reset_prefix_cache?reset_running_requests=banana")
    assert status == 400 and "must be a boolean, got 'banana'" in json.loads(body)["error"]["message"]
    assert wait_for(lambda: _post(server.url + "/reset_prefix_cache?reset_running_requests=off") == (200, b""), 10,
                    "the reset, once idle")
    again = client.chat.completions.create(model="tiny", messages=chats[0], max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # every block forgotten
    assert again.choices[0].message.content == first.choices[0].message.content


def _post(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_client_disconnect_frees_kv_blocks(server):
    before = server.engine_stats()
    assert before.num_running == 0 and before.num_free_blocks == before.num_kv_blocks
    client = openai_client(server)
    stream = client.completions.create(model="tiny", prompt="Tell me a very long story", max_tokens=900,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = 0
    for _ in stream:
        chunks += 1
        if chunks == 3:
            break
    during = server.engine_stats()
    assert during.num_running + during.num_waiting == 1
    assert during.num_free_blocks < during.num_kv_blocks
    stream.close()  # the client goes away mid-generation
    after = wait_for(lambda: (s := server.engine_stats()).num_running == 0 and s, 20,
                     "the engine to drop the abandoned request")
    assert after.num_waiting == 0
    assert after.num_free_blocks == after.num_kv_blocks


def scrape(server: Server) -> dict:
    """``/metrics`` (from whichever frontend answers) as {(name, label values...): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def test_metrics_and_access_log(server):
    import openai

    assert os.path.isdir(os.path.join(server.runtime_dir, "metrics"))
    before = scrape(server)
    client = openai_client(server)
    done = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny", prompt="Tell me a very long story", max_tokens=900,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    cut_id = next(iter(stream)).id
    stream.close()  # the client goes away mid-generation
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    cut = wait_for(lambda: re.search(rf"request_id={cut_id} .*", server.log()), 20, "the cut stream's access line")
    cut_fields = dict(kv.split("=", 1) for kv in cut.group(0).split())
    assert cut_fields["status"] == "200" and cut_fields["finish_reason"] == "abort"
    after = scrape(server)
    common = (("engine", "0"), ("model_name", "tiny"))

    def d(name, *labels):
        key = (name, *sorted(common + labels))
        return after.get(key, 0.0) - before.get(key, 0.0)

    reason = ("finished_reason",)
    assert [d("tokenmill:request_success_total", reason + (r,)) for r in ("length", "abort", "stop", "error")] == [
        1, 1, 0, 0]
    assert d("tokenmill:prompt_tokens_total") == done.usage.prompt_tokens + int(cut_fields["prompt_tokens"])
    assert d("tokenmill:generation_tokens_total") == MAX_TOKENS + int(cut_fields["generation_tokens"])
    for h in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
              "request_prompt_tokens", "request_generation_tokens"):
        assert d(f"tokenmill:{h}_count") == 2, h
    assert d("tokenmill:inter_token_latency_seconds_count") == MAX_TOKENS - 1 + int(cut_fields["generation_tokens"]) - 1
    http = ("tokenmill:http_requests_total", ("handler", "/v1/completions"), ("method", "POST"))
    assert after[(*http, ("status", "4xx"))] - before.get((*http, ("status", "4xx")), 0) == 1
    assert after[(*http, ("status", "2xx"))] - before.get((*http, ("status", "2xx")), 0) == 2
    assert after[("tokenmill:kv_cache_usage_perc", *common)] >= 0
    assert ("tokenmill:num_requests_running", *common) in after and ("tokenmill:num_preemptions_total", *common) in after
    line = re.search(rf"request_id={done.id} .*", server.log()).group(0)
    assert f"prompt_tokens={done.usage.prompt_tokens} " in line and f"generation_tokens={MAX_TOKENS} " in line
    assert "finish_reason=length" in line and "status=200" in line
    assert PROMPTS[1] not in server.log() and "very long story" not in server.log()  # prompts are not logged


def test_a_client_that_stops_reading_is_cut_off_and_its_requests_aborted(server):
    # sixteen long streams with 20 logprobs per token (~1.5 KB each) for a client that reads nothing:
    # with a 64K send buffer the kernel holds a few steps' worth, then the write timeout runs
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", server.port))
    data = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "n": 16,
                       "max_tokens": 900, "logprobs": True, "top_logprobs": 20, "ignore_eos": True,
                       "stream": True}).encode()
    cuts = server.log().count("connection cut")
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
    t0 = time.monotonic()
    wait_for(lambda: server.engine_stats().num_running == 16, 20, "the 16 choices to run")
    running = 16  # what the engine ran just before the cut: a sample taken before the log showed none
    while True:
        sample = server.engine_stats().num_running
        if server.log().count("connection cut") > cuts:
            break
        running = sample
        assert time.monotonic() - t0 < 60, "the stalled reader was never cut off"
    t_cut = time.monotonic()
    done = wait_for(lambda: (s := server.engine_stats()).num_running == 0 and s, 2, "its requests aborted")
    print(f"cut off {t_cut - t0:.1f}s after its request (write timeout {WRITE_TIMEOUT}s) while the engine ran "
          f"{running} of its choices; all aborted {time.monotonic() - t_cut:.2f}s after the cut")
    assert running == 16  # cut mid-generation, not after it
    assert done.num_free_blocks == done.num_kv_blocks
    slow.settimeout(10)
    with contextlib.suppress(ConnectionResetError):  # what was in flight, then the cut (never a hang)
        while slow.recv(1 << 16):
            pass
    slow.close()


def test_killed_frontend_is_restarted_and_the_other_keeps_serving(server, offline):
    old = server.pids("tokenmill-frontend-0")[-1]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not pid_alive(old), 10, "the frontend to die")
    client = openai_client(server)
    prompt = PROMPTS[0]
    for _ in range(6):  # every new connection lands on the surviving frontend
        with openai_client(server) as c:
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
            assert r.choices[0].text == offline[prompt].text
    new = wait_for(lambda: len(server.pids("tokenmill-frontend-0")) == 2 and server.pids("tokenmill-frontend-0")[-1],
                   30, "the launcher to restart frontend-0")
    assert pid_alive(new)
    wait_for(lambda: "tokenmill-frontend-0 is ready again" in server.log(), 120, "the new frontend-0 to be ready")
    # the dead one's engine gauges no longer count (its counters do)
    assert not os.path.exists(os.path.join(server.runtime_dir, "metrics", f"gauge_livemostrecent_{old}.db"))
    assert os.path.exists(os.path.join(server.runtime_dir, "metrics", f"counter_{old}.db"))
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == offline[prompt].text
    assert server.proc.poll() is None


def test_a_conversation_goes_on_by_previous_response_id_on_either_frontend(server):
    """The frontends keep Responses in one file (in the server's runtime dir): a turn that continues the last one
    by its id, over a new connection each time (either frontend), answers greedily as the whole conversation sent
    again does."""
    kw = dict(model="tiny", max_output_tokens=6, temperature=0)
    previous, whole = None, []
    for text in ("Hello!", "What is 2+2?", "And 3+3?"):
        with openai_client(server) as c:
            r = c.responses.create(input=text, previous_response_id=previous, **kw)
        whole.append({"role": "user", "content": text})
        with openai_client(server) as c:
            again = c.responses.create(input=whole, store=False, **kw)
        assert (r.output_text, r.usage.input_tokens) == (again.output_text, again.usage.input_tokens)
        whole += [o.model_dump() for o in r.output]
        previous = r.id
    assert os.path.isfile(os.path.join(server.runtime_dir, "responses.sqlite"))


def test_a_background_response_runs_on_the_real_engine_and_is_read_again_on_either_frontend(server):
    """``background: true`` through the launcher's frontends and the real engine: answered ``queued``, polled over new
    connections (either frontend) to the greedy answer the same request gets in the foreground; created streamed, its
    events read again whole, ending with the Response as stored; one cancelled stops in the engine."""
    kw = dict(model="tiny", input="Tell me a story.", max_output_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    with openai_client(server) as c:
        r = c.responses.create(background=True, **kw)
    assert r.status == "queued" and r.background
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        with openai_client(server) as c:
            r = c.responses.retrieve(r.id)
    with openai_client(server) as c:
        fore = c.responses.create(store=False, **kw)
    assert (r.status, r.output_text, r.usage.output_tokens) == ("incomplete", fore.output_text, 12)
    with openai_client(server) as c, c.responses.create(background=True, stream=True, **kw) as stream:
        response_id = next(iter(stream)).response.id
    with openai_client(server) as c:
        events = list(c.responses.retrieve(response_id, stream=True))
        stored = c.responses.retrieve(response_id)
    assert events[-1].type == "response.incomplete" and events[-1].response.model_dump() == stored.model_dump()
    assert stored.output_text == fore.output_text
    aborted = ("tokenmill:request_success_total", ("engine", "0"), ("finished_reason", "abort"), ("model_name", "tiny"))
    before = scrape(server).get(aborted, 0.0)
    with openai_client(server) as c:
        long = c.responses.create(background=True, **{**kw, "max_output_tokens": 900})
        assert c.responses.cancel(long.id).status == "cancelled"
    wait_for(lambda: scrape(server).get(aborted, 0.0) == before + 1, 20, "the cancelled response aborted")
    with openai_client(server) as c:
        assert c.responses.retrieve(long.id).status == "cancelled"


def test_bench_serving_smoke(server, tmp_path):
    import json

    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_serving.py"), "--base-url",
                        server.url + "/v1", "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                        "--request-rate", "20", "--max-concurrency", "4", "--slo-ttft-ms", "60000",
                        "--save-json", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Serving Benchmark Result" in r.stdout
    result = json.loads(r.stdout.strip().splitlines()[-1])
    saved = json.loads(out.read_text())
    assert len(saved.pop("requests")) == 6 and result == saved  # the file also keeps each request's timings
    assert result["model"] == "tiny" and result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 8  # ignore_eos: exactly --output-len each
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = result[key]
        assert 0 < d["median"] <= d["p90"] <= d["p99"]


def test_sigterm_exits_zero_and_removes_runtime_dir(server):
    runtime = server.runtime_dir
    children = [server.pids("tokenmill-engine")[-1], server.pids("tokenmill-frontend-0")[-1],
                server.pids("tokenmill-frontend-1")[-1]]
    assert os.path.isdir(runtime)
    assert server.stop(signal.SIGTERM) == 0
    # the engine, stopped after the frontends, has nothing to drain: it says it drains, a second SIGTERM ends it
    assert "asked again: stopping now (0 requests under way)" in server.log()
    assert not os.path.exists(runtime)
    assert not any(pid_alive(pid) for pid in children)


def test_a_second_signal_cuts_the_drain_short_and_the_exit_code_says_so(tiny_llama):
    """A first SIGINT drains the streams; a second (after a second: one at once is the same stop delivered twice)
    kills every process, and the launcher exits 128 + its number, as a shell reports a process a signal ended."""
    s = Server("--model", tiny_llama, "--served-model-name", "tiny", "--max-num-seqs", "1")
    conns = []
    try:
        for i in range(3):  # one running, two waiting: the drain lasts seconds
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": f"Long {i}", "stream": True,
                                                                "max_tokens": 900, "ignore_eos": True}),
                         {"content-type": "application/json"})
            conns.append(conn)
        assert conns[0].getresponse().read1(65536).startswith(b"data:")
        s.proc.send_signal(signal.SIGINT)
        time.sleep(1.2)
        assert s.proc.poll() is None  # (draining)
        assert s.stop(signal.SIGINT) == 128 + signal.SIGINT
        assert "second signal: killing all processes" in s.log()
    finally:
        for conn in conns:
            conn.close()
        s.close()
