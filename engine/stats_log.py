"""The engine's periodic stats line, vLLM's "Avg prompt throughput: ..." (``--disable-log-stats`` turns it off).

While the engine works, one INFO line every ``interval`` seconds (``EngineConfig.log_stats_interval``, 10 as
vLLM's; the last one when the interval ends, idle or not) says what its steps did in that interval: prompt and generation tokens per second, the requests
running and waiting, the KV cache's use and the prefix cache's hit rate (as vLLM's, that one since start),
then the steps, apart: decode-only steps and steps that carried prompt tokens, each with its median time.
Where the two medians differ by far more than the prompt tokens explain, the host's work for the steps with
prompts (eager ones: too long for their graphs, or no graphs) is what the streams wait for. A step's time
is the engine's ``step()`` call: under asynchronous scheduling the period from one step to the next, counted
to the step it launched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from engine.protocol import Stats


class StatsLog:
    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._start = 0.0  # (the interval's first step sets it)
        self._prompt_tokens = self._generated = 0
        self._decode_steps: list[float] = []  # seconds of each decode-only step since the last line...
        self._prompt_steps: list[float] = []  # ... and of each step that carried prompt tokens

    def step(self, seconds: float, prompt_tokens: int, generated: int, scheduled: bool = True) -> None:
        """One step: how long it took, the prompt tokens it computed (not those found cached), tokens it sampled.
        The first since the last line starts the next line's interval (an idle gap before it is none of it).
        ``scheduled`` False: it only collected the tokens of the step before (asynchronous scheduling's last)."""
        self._generated += generated
        if not scheduled:
            return
        if not self._decode_steps and not self._prompt_steps:
            self._start = self.clock() - seconds
        (self._prompt_steps if prompt_tokens else self._decode_steps).append(seconds)
        self._prompt_tokens += prompt_tokens

    def remaining(self) -> float | None:
        """Seconds until the line for the steps counted is due (None: no step counted, no line to come)."""
        if not self._decode_steps and not self._prompt_steps:
            return None
        return self._start + self.interval - self.clock()

    def due(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

    def line(self, stats: Stats) -> str | None:
        """The line for the steps since the last one (None without any); the count starts afresh."""
        decode, prompt = self._decode_steps, self._prompt_steps
        if not decode and not prompt:
            return None
        elapsed = max(self.clock() - self._start, 1e-9)
        text = (f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._generated / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {stats.prefix_cache_hit_rate * 100:.1f}% (since start), "
                f"Steps: {len(decode)} decode-only{_median(decode)}, {len(prompt)} with prompt tokens{_median(prompt)}")
        self._prompt_tokens = self._generated = 0
        self._decode_steps, self._prompt_steps = [], []
        return text


def _median(seconds: list[float]) -> str:
    return f" (median {statistics.median(seconds) * 1e3:.2f} ms)" if seconds else ""
