"""Prometheus metrics of a frontend process, and ``GET /metrics`` in the text format.

Names are vLLM's with the ``tokenmill:`` prefix, the same labels (``model_name``,
``engine``) and vLLM's bucket edges, so a vLLM dashboard works after a prefix
rename (``tools/grafana_dashboard.json`` is one for tokenmill).

- From the engine's STATS (each frontend's liveness pings, every 2 s): gauges
  ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``,
  ``prefix_cache_hit_rate`` (since start), and the counters ``num_preemptions_total`` and, with speculative
  decoding, ``spec_decode_num_drafts_total``, ``spec_decode_num_draft_tokens_total``,
  ``spec_decode_num_accepted_tokens_total`` (vLLM's: the acceptance rate is accepted / draft tokens),
  one series per engine (``engine`` = its index under data parallel, "0" with one); and
  ``engine_draining``, 1 while an engine drains (stopped with ``--shutdown-timeout``: it runs its
  requests to their end and takes no new ones), from when it says so (seen where engines run apart,
  ``tokenmill engine``: a stopped ``tokenmill serve`` stops its frontends first).
  The per-request counters and histograms below carry ``engine="0"``: they are
  the frontend's, whichever engine ran the request.
- Per engine request (one per choice: a call with ``n`` = 2 is two), counted when
  it ends: ``request_success_total{finished_reason}`` (stop, length, abort,
  timeout, error), ``prompt_tokens_total``, ``prompt_tokens_cached_total``,
  ``generation_tokens_total``, ``prefix_cache_queries_total`` /
  ``prefix_cache_hits_total`` (the same prompt and cached tokens, under vLLM v1's
  names), and histograms ``e2e_request_latency_seconds``,
  ``request_prompt_tokens``, ``request_generation_tokens`` (one sample per ended
  request), ``time_to_first_token_seconds`` (per request with a token),
  ``inter_token_latency_seconds`` (per token after the first),
  ``request_time_per_output_token_seconds`` (per request with two tokens or more),
  ``request_queue_time_seconds``, ``request_prefill_time_seconds``,
  ``request_decode_time_seconds``, ``request_inference_time_seconds`` (per
  request the engine answered at all).
- ``http_requests_total{handler, method, status}``: responses by status class
  (``2xx``, ``4xx``, ...), refusals by the HTTP layer and client disconnects
  before an answer (499) included.

Times are the frontend's view. TTFT and end-to-end latency run from the HTTP
request (or WebSocket message) to the token / the end, tokenization included,
as a client sees them. The engine reports no per-request times, so queue time is
estimated: from sending ADD to the end of the last engine step this frontend saw
before the one that produced the request's first output (0 when none ended in
between: an idle engine, or a step that only served other frontends). Prefill
runs from there to that first output, decode from the first token to the end.

Several frontend processes: prometheus_client's multiprocess mode, switched on by
``PROMETHEUS_MULTIPROC_DIR`` (the launcher sets it to a folder of its runtime dir
before any frontend starts). Counters and histograms are summed over the
processes' files, a restarted frontend's included; engine gauges use
``livemostrecent``, so the newest STATS of a live frontend wins and nothing is
counted twice. Without the variable (a lone frontend in tests) the registry is
this process's own.

The hot path stays cheap: a multiprocess write costs microseconds, so per-token
numbers (generation tokens, inter-token latencies) are summed in plain Python and
written out when a request ends and at every STATS.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Iterable

import prometheus_client as prom
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric

from engine.protocol import Stats

prom.disable_created_metrics()  # as vLLM: *_created series double the output and help no dashboard

PREFIX = "tokenmill:"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what every Prometheus server reads
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")

# vLLM's bucket edges (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


# engine counters that STATS carry as totals since start: kept as livemostrecent gauges (a sum over
# frontends would count them once per frontend) and shown as counters
_ENGINE_COUNTERS = {PREFIX + n for n in ("num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                         "spec_decode_num_accepted_tokens")}


class _Exposition:
    """A collector over ``source`` that shows the engine-total gauges as the counters they are."""

    def __init__(self, source) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        for m in self.source.collect():
            if m.name in _ENGINE_COUNTERS and m.type == "gauge":
                c = Metric(m.name, m.documentation, "counter")
                c.samples = [s._replace(name=m.name + "_total") for s in m.samples]
                yield c
            else:
                yield m


class _Pending:
    """Per-token numbers not yet written to the (multiprocess) metrics."""

    __slots__ = ("generation_tokens", "itl_counts", "itl_sum")

    def __init__(self, num_buckets: int) -> None:
        self.generation_tokens = 0
        self.itl_counts = [0] * num_buckets
        self.itl_sum = 0.0


class Metrics:
    """One frontend's metrics for one engine; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, model_name: str, max_model_len: int, engine: str = "0") -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # metric objects live in a registry of their own: in multiprocess mode what is shown comes
        # from every process's files instead, read by a MultiProcessCollector
        own = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = (model_name, engine)

        def gauge(name: str, doc: str):
            return prom.Gauge(PREFIX + name, doc, labels, registry=own, multiprocess_mode="livemostrecent")

        def counter(name: str, doc: str):
            return prom.Counter(PREFIX + name, doc, labels, registry=own).labels(*values)

        def histogram(name: str, doc: str, buckets: list[float]):
            return prom.Histogram(PREFIX + name, doc, labels, registry=own, buckets=buckets).labels(*values)

        # engine gauges: one child per engine (label "engine": its index under data parallel)
        self._model_name, self._engine = model_name, engine
        self._engine_gauges = (
            gauge("num_requests_running", "Number of requests in model execution batches."),
            gauge("num_requests_waiting", "Number of requests waiting to be processed."),
            gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            gauge("prefix_cache_hit_rate",
                  "Prompt tokens served from the prefix cache / prompt tokens, since the engine started."),
            gauge("num_preemptions", "Cumulative number of preemptions from the engine."),
            gauge("spec_decode_num_drafts", "Number of spec decoding drafts (decodes that had draft tokens)."),
            gauge("spec_decode_num_draft_tokens", "Number of draft tokens."),
            gauge("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            gauge("engine_draining", "1 while the engine drains: it runs its requests to their end and takes no "
                                     "new ones."))
        self._engine_children: dict[str, tuple] = {}

        success = prom.Counter(PREFIX + "request_success", "Count of finished requests by finish reason "
                               "(abort: the client went away or cancelled; error: refused or failed).",
                               [*labels, "finished_reason"], registry=own)
        self.finished = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.cached_tokens = counter("prompt_tokens_cached", "Number of prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.cache_queries = counter("prefix_cache_queries", "Prefix cache queries, in prompt tokens.")
        self.cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in cached prompt tokens.")

        len_buckets = buckets_1_2_5(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time per output token (after the first) per request, in seconds.",
                              ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Histogram of time spent waiting for the engine (estimated by the frontend).",
                               LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Number of prefill tokens processed.", len_buckets)
        self.generation_len = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                        len_buckets)
        self._http = prom.Counter(PREFIX + "http_requests", "HTTP responses by handler, method and status class.",
                                  ["handler", "method", "status"], registry=own)
        self._http_children: dict[tuple[str, str, str], object] = {}
        self._pending = _Pending(len(ITL_BUCKETS) + 1)

        source = multiprocess.MultiProcessCollector(None) if self.multiprocess else own
        self._exposition = CollectorRegistry(auto_describe=False)
        self._exposition.register(_Exposition(source))

    # ------------------------------------------------------------------ recording

    def _gauges_of(self, engine: str) -> tuple:
        children = self._engine_children.get(engine)
        if children is None:
            children = self._engine_children[engine] = tuple(
                g.labels(self._model_name, engine) for g in self._engine_gauges)
        return children

    def watch(self, client, engine: str) -> None:
        """Show ``client``'s engine (an ``EngineClient``) under label ``engine``: its numbers at each STATS, as
        they are now too, and zeros once it is lost."""
        client.on_stats = lambda s: self.engine_stats(s, engine, draining=client.draining)
        client.on_unhealthy = lambda: self.engine_unavailable(engine)
        if client.last_stats is not None and client.healthy:  # (one lost while connecting: its numbers are gone)
            client.on_stats(client.last_stats)

    def engine_stats(self, s: Stats, engine: str | None = None, draining: bool = False) -> None:
        """An engine's numbers, as one STATS brought them (and a chance to write out what is pending).

        ``engine``: its label (the engine's index under data parallel; default: this object's)."""
        gauges = self._gauges_of(engine or self._engine)
        for gauge, value in zip(gauges, (s.num_running, s.num_waiting, s.kv_usage, s.prefix_cache_hit_rate,
                                         s.num_preemptions, s.num_spec_drafts, s.num_spec_draft_tokens,
                                         s.num_spec_accepted_tokens, float(draining)), strict=True):
            gauge.set(value)
        self.flush()

    def engine_unavailable(self, engine: str | None = None) -> None:
        """An engine this frontend lost: its requests failed, so it runs and holds none (its gauges would stay at
        its last STATS for good, with a data-parallel server serving on), nor drains; its totals stay as they
        were."""
        gauges = self._gauges_of(engine or self._engine)
        for gauge in (*gauges[:3], gauges[-1]):  # (running, waiting, KV-cache usage; draining)
            gauge.set(0)

    def first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def tokens(self, num: int, gap: float | None) -> None:
        """``num`` tokens arrived together, ``gap`` seconds after the request's previous token
        (None: these are its first); each but a first one counts as an inter-token latency of
        ``gap / num`` (0 for the first one's companions)."""
        p = self._pending
        p.generation_tokens += num
        if gap is None:
            num -= 1
            gap = 0.0
        if num > 0:
            each = gap / num
            p.itl_counts[bisect_left(ITL_BUCKETS, each)] += num
            p.itl_sum += gap

    def request_finished(self, reason: str, prompt_tokens: int, cached_tokens: int, generation_tokens: int,
                         e2e: float, queue: float | None = None, prefill: float | None = None,
                         decode: float | None = None) -> None:
        """One engine request ended. ``queue`` and ``prefill`` are None when the engine never answered
        it; ``decode`` is None without a token."""
        self.finished.get(reason, self.finished["error"]).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cache_queries.inc(prompt_tokens)
        if cached_tokens:
            self.cached_tokens.inc(cached_tokens)
            self.cache_hits.inc(cached_tokens)
        self.e2e.observe(e2e)
        self.prompt_len.observe(prompt_tokens)
        self.generation_len.observe(generation_tokens)
        if queue is not None:
            self.queue.observe(queue)
            self.prefill.observe(prefill)
            self.inference.observe(prefill + (decode or 0.0))
        if decode is not None:
            self.decode.observe(decode)
            if generation_tokens > 1:
                self.tpot.observe(decode / (generation_tokens - 1))
        self.flush()

    def http_response(self, handler: str, method: str, status: int) -> None:
        key = (handler, method, f"{status // 100}xx")
        child = self._http_children.get(key)
        if child is None:
            child = self._http_children[key] = self._http.labels(*key)
        child.inc()

    def flush(self) -> None:
        """Write the per-token numbers summed since the last flush."""
        p = self._pending
        if p.generation_tokens:
            self.generation_tokens.inc(p.generation_tokens)
            p.generation_tokens = 0
        if p.itl_sum or any(p.itl_counts):
            # Histogram.observe, n samples at once: the sum, and each bucket's own (not cumulative) count
            self.itl._sum.inc(p.itl_sum)
            for i, n in enumerate(p.itl_counts):
                if n:
                    self.itl._buckets[i].inc(n)
                    p.itl_counts[i] = 0
            p.itl_sum = 0.0

    # ------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """Every frontend's metrics (this one's pending numbers written first), in the text format."""
        self.flush()
        return generate_latest(self._exposition)

