"""Pictures of ``bench_serving.py`` runs: one run's distributions, or saved runs side by side.

``plot_run(summary, path)``: TTFT and ITL histograms and output tokens/s over
time, from the per-request samples a run keeps (``summary["requests"]``: each
request's start, TTFT, ITL gaps, end-to-end time and output tokens, seconds from
the first request's start). ``plot_compare([(label, summary), ...], path)``:
the same runs overlaid, TTFT and ITL as CDFs (so different request counts
compare), tokens/s over time, and the headline figures as bars. A saved JSON
without samples (an older run) still compares: its CDFs are drawn through the
percentiles it reports.

matplotlib with the Agg backend (files only, no display); imported only by the
benchmark, never by the server.
"""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PERCENTILES = (("median", 0.5), ("p90", 0.9), ("p99", 0.99))


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def token_times(summary: dict) -> list[tuple[float, float]]:
    """(seconds from the start, tokens) for each streamed chunk of each successful request."""
    out = []
    for r in summary.get("requests", []):
        if not r["ok"] or r["ttft_s"] is None:
            continue
        chunks = 1 + len(r["itl_s"])
        per_chunk = r["output_tokens"] / chunks
        t = r["start_s"] + r["ttft_s"]
        out.append((t, per_chunk))
        for gap in r["itl_s"]:
            t += gap
            out.append((t, per_chunk))
    return out


def throughput_series(summary: dict, bins: int = 40) -> tuple[list[float], list[float]]:
    """Output tokens/s in ``bins`` equal slices of the run: (slice midpoints, rates)."""
    times = token_times(summary)
    if not times:
        return [], []
    end = max(t for t, _ in times) or 1e-9
    width = end / bins
    counts = [0.0] * bins
    for t, n in times:
        counts[min(int(t / width), bins - 1)] += n
    return [(i + 0.5) * width for i in range(bins)], [c / width for c in counts]


def samples(summary: dict, key: str) -> list[float] | None:
    """A run's TTFT ("ttft") or ITL ("itl") samples in ms, or None when the JSON kept none."""
    reqs = summary.get("requests")
    if not reqs:
        return None
    ok = [r for r in reqs if r["ok"]]
    if key == "ttft":
        return [r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None]
    return [g * 1000 for r in ok for g in r["itl_s"]]


def _cdf(ax, summary: dict, key: str, label: str) -> None:
    values = samples(summary, key)
    if values:
        v = sorted(values)
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=label)
    else:  # only the summary's percentiles
        d = summary[f"{key}_ms"]
        ax.plot([d[k] for k, _ in PERCENTILES], [q for _, q in PERCENTILES], marker="o", label=f"{label} (pcts)")


def _hist(ax, values: list[float] | None, title: str, summary_dist: dict) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    if values:
        ax.hist(values, bins=min(50, max(5, int(math.sqrt(len(values))))), color="tab:blue", alpha=0.8)
    for (name, _), style in zip(PERCENTILES, (":", "--", "-."), strict=True):
        ax.axvline(summary_dist[name], color="tab:red", linestyle=style, label=f"{name} {summary_dist[name]:.1f}")
    ax.legend(fontsize="small")


def _title(summary: dict) -> str:
    return (f"{summary.get('model')} · {summary.get('num_prompts')} requests · "
            f"{summary.get('output_throughput', 0):.1f} out tok/s · {summary.get('request_throughput', 0):.2f} req/s")


def plot_run(summary: dict, path: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _hist(axes[0], samples(summary, "ttft"), "Time to first token", summary["ttft_ms"])
    _hist(axes[1], samples(summary, "itl"), "Inter-token latency", summary["itl_ms"])
    x, y = throughput_series(summary)
    axes[2].plot(x, y)
    axes[2].set_title("Output tokens/s over time")
    axes[2].set_xlabel("s since the first request")
    fig.suptitle(_title(summary))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


HEADLINE = (("out tok/s", lambda s: s["output_throughput"]), ("req/s", lambda s: s["request_throughput"]),
            ("TTFT p50", lambda s: s["ttft_ms"]["median"]), ("TTFT p99", lambda s: s["ttft_ms"]["p99"]),
            ("ITL p50", lambda s: s["itl_ms"]["median"]), ("ITL p99", lambda s: s["itl_ms"]["p99"]))


def _headline_bars(ax, runs: list[tuple[str, dict]]) -> None:
    """Each figure relative to the first run's (1.0), its own value (ms for latencies) written on the bar."""
    width = 0.8 / len(runs)
    base = [f(runs[0][1]) or 1e-12 for _, f in HEADLINE]
    for i, (label, s) in enumerate(runs):
        values = [f(s) for _, f in HEADLINE]
        bars = ax.bar([k + i * width for k in range(len(HEADLINE))], [v / b for v, b in zip(values, base, strict=True)],
                      width, label=label)
        ax.bar_label(bars, [f"{v:.3g}" for v in values], fontsize="x-small", rotation=90, padding=2)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([k + width * (len(runs) - 1) / 2 for k in range(len(HEADLINE))], [n for n, _ in HEADLINE],
                  fontsize="small")
    ax.set_ylabel(f"relative to {runs[0][0]}")
    ax.margins(y=0.2)
    ax.set_title("Headline figures (throughput: higher is better; latency, ms: lower is better)")
    ax.legend(fontsize="small")


def plot_compare(runs: list[tuple[str, dict]], path: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    for label, s in runs:
        _cdf(axes[0][0], s, "ttft", label)
        _cdf(axes[0][1], s, "itl", label)
        x, y = throughput_series(s)
        axes[1][0].plot(x, y, label=label)
    for ax, title in ((axes[0][0], "Time to first token (CDF)"), (axes[0][1], "Inter-token latency (CDF)")):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.legend(fontsize="small")
    axes[1][0].set_title("Output tokens/s over time")
    axes[1][0].set_xlabel("s since the first request")
    axes[1][0].legend(fontsize="small")
    _headline_bars(axes[1][1], runs)
    fig.suptitle(" vs ".join(label for label, _ in runs))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
