"""``frontends.metrics``, ``frontends.access_log`` and ``frontends.logs`` without a server.

The arithmetic (per-token numbers summed in Python and written out in bulk equal
what ``observe`` would have written), the exposition (names, labels, vLLM's
buckets, engine totals shown as counters), and prometheus_client's multiprocess
mode with several processes writing into one folder: counters summed, engine
gauges never counted twice, a dead process's gauges dropped; the access line and
JSON log records; the Grafana dashboard against the metrics that exist; and a
``Generation`` reporting each choice once, however it ends. What a running
frontend counts is in test_frontend_metrics.py and test_server_e2e.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import Stats
from frontends import logs
from frontends.access_log import AccessLog, CallInfo
from frontends.http import Request
from frontends.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS, Metrics, buckets_1_2_5

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scrape(text: str) -> dict:
    """{(sample name, frozenset(labels without model_name/engine)): value}, and each family's type."""
    out, types = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out[(s.name, frozenset(labels.items()))] = s.value
    return {"samples": out, "types": types}


def value(parsed: dict, name: str, **labels) -> float:
    return parsed["samples"].get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


def test_buckets_are_vllms():
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(4096)[-2:] == [1000, 2000]
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0 and len(ITL_BUCKETS) == 19
    assert LATENCY_BUCKETS[0] == 0.3 and LATENCY_BUCKETS[-1] == 7680.0 and len(LATENCY_BUCKETS) == 21


def test_single_process_exposition_and_bulk_itl(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    m = Metrics("tiny", 512)
    m.engine_stats(Stats(num_waiting=3, num_running=2, kv_usage=0.25, num_preemptions=4, prefix_cache_hit_rate=0.5))
    m.first_token(0.2)
    m.tokens(2, None)  # a first token and a companion: one ITL of 0
    m.tokens(1, 0.03)
    m.tokens(4, 0.2)  # four at once after 0.2 s: four ITLs of 0.05
    m.request_finished("length", 10, 4, 7, e2e=0.9, queue=0.1, prefill=0.15, decode=0.6)
    m.request_finished("abort", 5, 0, 0, e2e=0.4)  # aborted before the engine answered
    m.http_response("/v1/completions", "POST", 200)
    m.http_response("/v1/completions", "POST", 499)
    text = m.render().decode()
    p = scrape(text)
    assert 'model_name="tiny"' in text and 'engine="0"' in text
    assert p["types"]["tokenmill:num_preemptions"] == "counter"  # an engine total, shown as the counter it is
    assert value(p, "tokenmill:num_preemptions_total") == 4
    assert value(p, "tokenmill:num_requests_running") == 2 and value(p, "tokenmill:num_requests_waiting") == 3
    assert value(p, "tokenmill:kv_cache_usage_perc") == 0.25 and value(p, "tokenmill:prefix_cache_hit_rate") == 0.5
    assert value(p, "tokenmill:generation_tokens_total") == 7
    assert value(p, "tokenmill:prompt_tokens_total") == 15 and value(p, "tokenmill:prompt_tokens_cached_total") == 4
    assert value(p, "tokenmill:prefix_cache_queries_total") == 15 and value(p, "tokenmill:prefix_cache_hits_total") == 4
    assert value(p, "tokenmill:request_success_total", finished_reason="length") == 1
    assert value(p, "tokenmill:request_success_total", finished_reason="abort") == 1
    assert value(p, "tokenmill:request_success_total", finished_reason="stop") == 0
    assert value(p, "tokenmill:http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 1
    assert value(p, "tokenmill:http_requests_total", handler="/v1/completions", method="POST", status="4xx") == 1
    # the bulk-written ITLs are exactly what observe() would have made of 0, 0.03 and 4 x 0.05
    itl = "tokenmill:inter_token_latency_seconds"
    assert value(p, itl + "_count") == 6 and value(p, itl + "_sum") == pytest.approx(0.23)
    assert value(p, itl + "_bucket", le="0.01") == 1 and value(p, itl + "_bucket", le="0.05") == 6
    assert value(p, "tokenmill:e2e_request_latency_seconds_count") == 2
    assert value(p, "tokenmill:request_generation_tokens_count") == 2
    assert value(p, "tokenmill:request_prompt_tokens_sum") == 15
    assert value(p, "tokenmill:request_prompt_tokens_bucket", le="5.0") == 1
    assert value(p, "tokenmill:time_to_first_token_seconds_count") == 1
    assert value(p, "tokenmill:request_queue_time_seconds_count") == 1  # only the one the engine answered
    assert value(p, "tokenmill:request_inference_time_seconds_sum") == pytest.approx(0.75)
    assert value(p, "tokenmill:request_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    assert not any(name.endswith("_created") for name, _ in p["samples"])


_WRITER = """
import os, sys
from engine.protocol import Stats
from frontends.metrics import Metrics
print(os.getpid())
m = Metrics("tiny", 512)
running, preempted, finished = (int(x) for x in sys.argv[1:4])
for _ in range(finished):
    m.tokens(3, None)
    m.request_finished("stop", 4, 0, 3, e2e=0.5, queue=0.0, prefill=0.1, decode=0.4)
m.http_response("/health", "GET", 200)
m.engine_stats(Stats(num_running=running, num_preemptions=preempted))
"""


def _write_metrics(env: dict, running: int, preempted: int, finished: int) -> int:
    """A separate process (a frontend) writes its metrics into the shared folder; its pid."""
    proc = subprocess.run([sys.executable, "-c", _WRITER, str(running), str(preempted), str(finished)], env=env,
                          cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


def test_multiprocess_sums_counters_and_never_double_counts_engine_gauges(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    # the second frontend saw the newer STATS
    pids = [_write_metrics(env, running, preempted, finished) for running, preempted, finished in ((5, 2, 3), (7, 3, 4))]
    read = ("from frontends.metrics import Metrics; import sys\n"
            "sys.stdout.write(Metrics('tiny', 512).render().decode())")

    def scrape_all() -> dict:
        out = subprocess.run([sys.executable, "-c", read], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return scrape(out.stdout)

    p = scrape_all()
    assert value(p, "tokenmill:request_success_total", finished_reason="stop") == 7  # 3 + 4
    assert value(p, "tokenmill:generation_tokens_total") == 21
    assert value(p, "tokenmill:e2e_request_latency_seconds_count") == 7
    assert value(p, "tokenmill:inter_token_latency_seconds_count") == 14  # 2 per request
    assert value(p, "tokenmill:http_requests_total", handler="/health", method="GET", status="2xx") == 2
    assert value(p, "tokenmill:num_requests_running") == 7  # the newest, not 5 + 7
    assert value(p, "tokenmill:num_preemptions_total") == 3  # the engine's total, not 2 + 3
    assert p["types"]["tokenmill:num_preemptions"] == "counter"
    # a frontend that died: its gauges go (the launcher calls this), its counters stay
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pids[1], str(tmp_path))
    assert not os.path.exists(tmp_path / f"gauge_livemostrecent_{pids[1]}.db")
    p = scrape_all()
    assert value(p, "tokenmill:request_success_total", finished_reason="stop") == 7
    assert value(p, "tokenmill:num_requests_running") == 5  # what the live one saw


# ----------------------------------------------------------------------------- logs


class _Gen:
    """What the access log reads of a Generation."""

    def __init__(self, first_token_at, reasons) -> None:
        self.first_token_at = first_token_at
        self.choices = [type("C", (), {"end_reason": r})() for r in reasons]
        self.num_prompt_tokens, self.num_cached_tokens, self.num_completion_tokens = 12, 8, 5


def _request(path: str = "/v1/completions", method: str = "POST") -> Request:
    req = Request()
    req.id, req.path, req.method = "cmpl-abc1", path, method
    req.started -= 0.5
    return req


def _records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tokenmill.access"]


def test_access_line_fields_and_prompt_only_on_request(caplog):
    caplog.set_level(logging.DEBUG, logger="tokenmill.access")
    req = _request()
    req.meta = CallInfo(_Gen(req.started + 0.125, ["length", "stop", "length"]), "a secret prompt")
    AccessLog()(req, 200)
    (rec,) = _records(caplog)
    f = rec.fields
    assert (f["request_id"], f["method"], f["endpoint"], f["status"]) == ("cmpl-abc1", "POST", "/v1/completions", 200)
    assert (f["prompt_tokens"], f["cached_tokens"], f["generation_tokens"]) == (12, 8, 5)
    assert f["ttft_s"] == 0.125 and 0.5 <= f["total_s"] < 5 and f["finish_reason"] == "length,stop"
    assert rec.levelno == logging.INFO and "prompt" not in f and "secret" not in rec.getMessage()
    assert rec.getMessage().startswith("request_id=cmpl-abc1 client=- method=POST endpoint=/v1/completions status=200 ")

    caplog.clear()
    AccessLog(log_prompts=True)(req, 200)
    (rec,) = _records(caplog)
    assert rec.fields["prompt"] == "a secret prompt" and 'prompt="a secret prompt"' in rec.getMessage()

    caplog.clear()
    AccessLog(enabled=False)(req, 200)
    AccessLog()(_request("/health", "GET"), 200)  # probes: DEBUG only
    AccessLog()(_request("/health", "GET"), 503)
    recs = _records(caplog)
    assert [(r.fields["endpoint"], r.levelno) for r in recs] == [("/health", logging.DEBUG), ("/health", logging.INFO)]
    assert "ttft_s" not in recs[0].fields


def test_json_formatter():
    fmt = logs.formatter("json")
    rec = logging.LogRecord("tokenmill.access", logging.INFO, __file__, 1, "%s", ("text form",), None)
    rec.fields = {"request_id": "r1", "status": 200, "ttft_s": None}
    line = json.loads(fmt.format(rec))
    assert line["request_id"] == "r1" and line["status"] == 200 and line["ttft_s"] is None
    assert line["level"] == "INFO" and line["logger"] == "tokenmill.access" and "message" not in line
    plain = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom %d", (1,), None)
    try:
        raise ValueError("bad")
    except ValueError:
        plain.exc_info = sys.exc_info()
    line = json.loads(fmt.format(plain))
    assert line["message"] == "boom 1" and "ValueError: bad" in line["exception"]
    with pytest.raises(ValueError):
        logs.formatter("xml")


def test_the_grafana_dashboard_queries_only_metrics_that_exist(monkeypatch):
    import re

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    m = Metrics("tiny", 512)
    m.engine_stats(Stats())
    m.http_response("/health", "GET", 200)
    exposed = {s_name for s_name, _ in scrape(m.render().decode())["samples"]}
    with open(os.path.join(ROOT, "tools", "grafana_dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"tokenmill:[a-z0-9_]+", e)}
    assert len(used) >= 15 and used <= exposed, used - exposed
    assert all("tokenmill:" in e for e in exprs)


# ----------------------------------------------------------------------------- a generation's reports


class _Recorder:
    """A Metrics stand-in: what a Generation reports."""

    def __init__(self) -> None:
        self.ttft, self.tokens_seen, self.finished = [], [], []

    def first_token(self, ttft):
        self.ttft.append(ttft)

    def tokens(self, num, gap):
        self.tokens_seen.append((num, gap))

    def request_finished(self, reason, prompt_tokens, cached_tokens, generation_tokens, e2e, queue=None,
                         prefill=None, decode=None):
        self.finished.append((reason, prompt_tokens, cached_tokens, generation_tokens, queue is not None,
                              decode is not None))


class _Client:
    def __init__(self, down: bool = False) -> None:
        self.down, self.aborted, self.ready = down, [], None

    def add(self, request_id, *args, stream=None, **kw):
        from frontends.engine_client import EngineUnavailable

        if self.down:
            raise EngineUnavailable("gone")
        return stream

    def abort(self, request_ids):
        self.aborted += request_ids


@pytest.fixture(scope="module")
def codec(smollm_tokenizer_dir):
    from frontends.text import TextCodec
    from frontends.tokenizer import load_tokenizer

    return TextCodec(load_tokenizer(smollm_tokenizer_dir))


def test_a_generation_reports_each_choice_once_however_it_ends(codec):
    import asyncio

    from engine.protocol import Delta, Error, SamplingParams
    from frontends.errors import ApiError
    from frontends.generation import Generation
    from frontends.text import StopMatcher

    ids = codec.encode("hello world, hello moon")
    params = SamplingParams(max_tokens=50, stop=["moon"])
    m, client = _Recorder(), _Client()
    gen = Generation(client, codec, "g", [ids], 3, lambda i: params, stop=StopMatcher(["moon"]), metrics=m)
    gen.start()
    # choice 0: two deltas in one batch are one arrival of 2 tokens; then a stop string ends it
    gen.stream.push(Delta("g-0", ids[:1], None, num_prompt_tokens=len(ids), num_cached_tokens=16))
    gen.stream.push(Delta("g-0", ids[1:2], None, num_prompt_tokens=len(ids), num_cached_tokens=16))
    gen.stream.push(Delta("g-1", [], "timeout", num_prompt_tokens=len(ids)))  # choice 1: deadline, no token
    asyncio.run(gen.next_updates())
    assert m.tokens_seen == [(2, None)] and len(m.ttft) == 1
    gen.stream.push(Delta("g-0", ids[2:], None, num_prompt_tokens=len(ids), num_cached_tokens=16))
    asyncio.run(gen.next_updates())
    assert m.tokens_seen[1][0] == len(ids) - 2 and m.tokens_seen[1][1] >= 0
    assert gen.choices[0].finish_reason == "stop" and client.aborted == ["g-0"]  # the stop string ended it
    gen.abort_unfinished()  # the caller went away: choice 2 never got an answer
    gen.abort_unfinished()
    assert m.finished == [("timeout", len(ids), 0, 0, True, False), ("stop", len(ids), 16, len(ids), True, True),
                          ("abort", len(ids), 0, 0, False, False)]

    m, client = _Recorder(), _Client()
    gen = Generation(client, codec, "e", [ids], 2, lambda i: params, metrics=m)
    gen.start()
    gen.stream.push(Error("e-1", 429, "rate_limit_error", "full"))
    with pytest.raises(ApiError):
        asyncio.run(gen.next_updates())
    # refused at the engine's door (its queue full): no engine request, not counted as one ended in error; nor
    # is the call's choice the engine had taken and not answered, aborted for it (back-pressure read as aborts)
    assert m.finished == [] and [c.end_reason for c in gen.choices] == ["abort", "error"]
    assert "e-0" in client.aborted
    m = _Recorder()
    gen = Generation(_Client(), codec, "h", [ids], 2, lambda i: params, metrics=m)
    gen.start()
    gen.stream.push(Delta("h-0", ids[:1], None, num_prompt_tokens=len(ids)))  # (answered: an engine request)
    asyncio.run(gen.next_updates())
    gen.stream.push(Error("h-1", 429, "rate_limit_error", "full"))
    with pytest.raises(ApiError):
        asyncio.run(gen.next_updates())
    assert [r[0] for r in m.finished] == ["abort"]
    m = _Recorder()
    gen = Generation(_Client(), codec, "f", [ids], 2, lambda i: params, metrics=m)
    gen.start()
    gen.stream.push(Error("f-1", 500, "internal_error", "the step failed"))  # (it ran, and failed)
    with pytest.raises(ApiError):
        asyncio.run(gen.next_updates())
    assert sorted(r[0] for r in m.finished) == ["abort", "error"]

    m = _Recorder()
    gen = Generation(_Client(down=True), codec, "d", [ids], 2, lambda i: params, metrics=m)
    with pytest.raises(ApiError) as e:
        gen.start()
    assert e.value.status == 503 and [r[0] for r in m.finished] == ["error", "error"]


def test_a_beam_search_whose_first_round_is_refused_at_the_door_is_no_requests(codec):
    """As a call's choices (above): a search whose first round met a full queue (429) never was engine requests;
    the client's abort of one under way is counted."""
    import asyncio
    from types import SimpleNamespace

    from engine.beam_search import BeamSearchParams
    from engine.protocol import Error, SamplingParams
    from frontends.beam_search import BeamGeneration
    from frontends.errors import ApiError

    class Client(_Client):
        def __init__(self):
            super().__init__()
            self.ready, self.streams = SimpleNamespace(eos_token_ids=[2]), []

        def add(self, request_id, *args, stream=None, **kw):
            self.streams.append((request_id, stream))
            return stream

    async def run(gen, client, refuse):
        task = asyncio.ensure_future(gen.next_updates())
        while not client.streams:
            await asyncio.sleep(0.01)
        if not refuse:  # (the client went away while the first round ran)
            task.cancel()
            return
        rid, stream = client.streams[-1]
        stream.push(Error(rid, 429, "rate_limit_error", "full"))
        with pytest.raises(ApiError):
            await task

    ids = codec.encode("hello world")
    for refuse in (True, False):
        m, client = _Recorder(), Client()
        gen = BeamGeneration(client, codec, "b", [ids], BeamSearchParams(2, 4, False), SamplingParams(max_tokens=4),
                             metrics=m)
        gen.start()
        asyncio.run(run(gen, client, refuse))
        gen.abort_unfinished()  # (as the API does once the call has failed)
        assert [r[0] for r in m.finished] == ([] if refuse else ["abort", "abort"])
        assert [c.end_reason for c in gen.choices] == ["abort", "abort"]
