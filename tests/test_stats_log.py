"""The engine's periodic stats line (engine.stats_log), on a clock the test moves."""

from __future__ import annotations

from engine.protocol import Stats
from engine.stats_log import StatsLog


def test_the_line_says_what_the_steps_since_the_last_one_did():
    now = [100.0]
    log = StatsLog(10.0, clock=lambda: now[0])
    stats = Stats(num_waiting=3, num_running=5, kv_usage=0.25, prefix_cache_hit_rate=0.5)
    assert log.line(stats) is None  # no step yet: no line
    for seconds in (0.004, 0.006, 0.005):
        log.step(seconds, 0, 5)  # decode-only steps of 5 sequences
    log.step(0.040, 1000, 5)  # one with a prompt chunk
    now[0] = 109.0
    assert not log.due()
    now[0] = 110.0
    assert log.due()
    line = log.line(stats)
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
                    "Running: 5 reqs, Waiting: 3 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0% "
                    "(since start), Steps: 3 decode-only (median 5.00 ms), 1 with prompt tokens (median 40.00 ms)")
    # counted afresh from there
    assert not log.due() and log.line(stats) is None
    log.step(0.001, 0, 7, scheduled=False)  # (a collect-only step: its tokens count, not the step)
    assert log.line(stats) is None
    now[0] = 150.0  # an idle gap, then one step: its interval begins with it
    log.step(0.002, 8, 0)
    assert 9.9 < log.remaining() < 10.0
    now[0] = 152.0
    line = log.line(stats)
    assert line.startswith("Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 3.5 tokens/s")
    assert line.endswith("Steps: 0 decode-only, 1 with prompt tokens (median 2.00 ms)")


def test_an_interval_is_zero_or_a_number_of_seconds():
    import math

    import pytest

    from engine.config import EngineConfig

    assert EngineConfig(log_stats_interval=0).log_stats_interval == 0
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="log_stats_interval must be 0"):
            EngineConfig(log_stats_interval=bad)
