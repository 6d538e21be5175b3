"""``tools/bench_serving.py``'s workloads: which requests go out when, with what, and the per-class report.

No server: results are synthetic, and ``run_benchmark`` sends through a stub
protocol (its end-to-end smoke test against a real server is in test_server_e2e.py).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tools import bench_serving as bs


def args_for(*argv: str):
    return bs.parse_args(["--quiet", *argv])


def result(cls: str, ttft: float, itl: list[float], ok: bool = True) -> bs.RequestResult:
    r = bs.RequestResult(ok=ok, prompt_tokens=10, output_tokens=len(itl) + 1 if ok else 0, ttft=ttft,
                         e2el=ttft + sum(itl), itl=list(itl), chunks=len(itl) + 1 if ok else 0, cls=cls)
    if not ok:
        r.error = "RuntimeError: boom"
    return r


def test_pick_urgent_is_seeded_and_spread():
    picked = bs.pick_urgent(100, 0.1, random.Random(2))
    assert len(picked) == 10
    assert sorted(i // 10 for i in picked) == list(range(10))  # one in each tenth
    assert picked == bs.pick_urgent(100, 0.1, random.Random(2))
    assert picked != bs.pick_urgent(100, 0.1, random.Random(3))
    assert bs.pick_urgent(4, 0.1, random.Random(0)) and len(bs.pick_urgent(4, 0.1, random.Random(0))) == 1
    assert bs.pick_urgent(10, 0.0, random.Random(0)) == set()
    assert bs.pick_urgent(10, 1.0, random.Random(0)) == set(range(10))


def test_jobs_per_workload():
    random_jobs = bs.make_jobs(args_for("--num-prompts", "5", "--input-len", "7"), random.Random(0))
    assert [(j.prompt, j.est_tokens) for j in random_jobs] == bs.make_prompts(5, 7, random.Random(0))
    assert all(j.cls == "" and j.priority is None and j.at is None and j.max_tokens == 64 for j in random_jobs)

    a = args_for("--workload", "mixed", "--num-prompts", "6", "--num-long", "2", "--long-input-len", "50",
                 "--long-output-len", "5", "--long-delay", "1.5", "--long-interval", "0.25")
    jobs = bs.make_jobs(a, random.Random(0))
    assert [j.cls for j in jobs] == ["short"] * 6 + ["long"] * 2
    assert [j.at for j in jobs] == [None] * 6 + [1.5, 1.75]
    assert [j.max_tokens for j in jobs] == [64] * 6 + [5, 5]
    assert [len(j.prompt.split()) for j in jobs] == [128] * 6 + [50, 50]
    assert all(j.priority is None for j in jobs)

    a = args_for("--workload", "two-priority", "--num-prompts", "50", "--urgent-fraction", "0.2",
                 "--urgent-priority", "-3", "--normal-priority", "1", "--seed", "4")
    jobs = bs.make_jobs(a, random.Random(4))
    urgent = bs.pick_urgent(50, 0.2, random.Random(4 + 2))
    assert {i for i, j in enumerate(jobs) if j.cls == "urgent"} == urgent and len(urgent) == 10
    assert all(j.priority == (-3 if j.cls == "urgent" else 1) and j.at is None for j in jobs)
    assert bs.extra_fields(a, jobs[0]) == {"ignore_eos": True, "priority": jobs[0].priority}
    assert bs.extra_fields(args_for("--no-ignore-eos"), bs.Job("x", 1, 1, priority=0)) == {"priority": 0}
    assert bs.extra_fields(args_for(), random_jobs[0]) == {"ignore_eos": True}
    # --logprobs, in each endpoint's words
    job = bs.Job("x", 1, 1)
    assert [bs.extra_fields(args_for("--logprobs", "20", "--endpoint", e), job) for e in
            ("completions", "chat", "llamacpp", "tgi", "ollama")] == [
        {"ignore_eos": True, "logprobs": 20}, {"ignore_eos": True, "logprobs": True, "top_logprobs": 20},
        {"ignore_eos": True, "n_probs": 20}, {"ignore_eos": True, "top_n_tokens": 20},
        {"ignore_eos": True, "logprobs": True, "top_logprobs": 20}]

    a = args_for("--workload", "two-client", "--num-prompts", "4", "--num-light", "2", "--light-output-len", "3",
                 "--light-delay", "1.5", "--light-interval", "0.5")
    jobs = bs.make_jobs(a, random.Random(0))
    assert [(j.cls, j.user, j.at, j.max_tokens) for j in jobs] == [("flood", "flood", None, 64)] * 4 + [
        ("light", "light", 1.5, 3), ("light", "light", 2.0, 3)]
    assert bs.extra_fields(a, jobs[-1]) == {"ignore_eos": True, "user": "light"}

    jobs = bs.make_jobs(args_for("--workload", "edit", "--num-prompts", "6", "--output-len", "200"), random.Random(1))
    assert [(j.prompt, j.est_tokens) for j in jobs] == bs.make_edit_prompts(6, random.Random(1))
    assert all(j.max_tokens == 200 and j.cls == "" and "```python\n" in j.prompt for j in jobs)
    assert len({j.prompt for j in jobs}) == 6
    for j in jobs:  # each asks to rename a name its code holds, in code Python can read
        code = j.prompt.split("```python\n")[1].removesuffix("```")
        compile(code, "edit", "exec")
        assert j.prompt.split()[1] in code


def test_summary_per_class(capsys):
    a = args_for("--workload", "mixed", "--num-long", "2")
    results = [result("short", 0.02, [0.01] * 9) for _ in range(4)] + [
        result("long", 0.3, [0.5, 0.5, 0.5]), result("long", 0.0, [], ok=False)]
    results[-2].in_flight = 3
    s = bs.summarize(a, results, 2.0)
    assert s["workload"] == "mixed" and s["workload_params"]["num_long"] == 2
    assert s["completed"] == 5 and s["failed"] == 1 and s["total_output_tokens"] == 4 * 10 + 4
    assert list(s["classes"]) == ["short", "long"]
    short, long = s["classes"]["short"], s["classes"]["long"]
    assert set(short) == set(long) == set(bs.metrics(a, results, 2.0)) <= set(s)
    assert (short["completed"], short["failed"], long["completed"], long["failed"]) == (4, 0, 1, 1)
    assert long["errors"] == {"RuntimeError: boom": 1} and short["errors"] == {}
    # each class's latencies come from its own requests only
    assert short["itl_ms"]["p99"] == pytest.approx(10.0) and long["itl_ms"]["median"] == pytest.approx(500.0)
    assert short["ttft_ms"]["mean"] == pytest.approx(20.0) and long["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert s["itl_ms"]["p99"] > 10.0  # the overall mixes both
    assert short["output_throughput"] + long["output_throughput"] == pytest.approx(s["output_throughput"])
    assert s["long_sent_during_short"] == 1
    bs.print_table(s)
    out = capsys.readouterr().out
    assert "Workload:" in out and " Class short " in out and " Class long " in out

    plain = bs.summarize(args_for(), [result("", 0.02, [0.01] * 3)], 1.0)
    assert plain["workload"] == "random" and "classes" not in plain and "workload_params" not in plain
    bs.print_table(plain)
    out = capsys.readouterr().out
    assert "Class" not in out and "Workload" not in out


def test_run_benchmark_schedules_long_requests_outside_the_concurrency_cap(monkeypatch):
    sent: list[tuple[float, bs.Job]] = []

    async def fake_send(client, args, job):
        sent.append((time.perf_counter(), job))
        r = bs.RequestResult(prompt_tokens=job.est_tokens, cls=job.cls, start=time.perf_counter())
        await asyncio.sleep(0.5 if job.cls == "short" else 0.05)
        r.got_chunk(time.perf_counter())
        r.output_tokens = 1
        r.finish()
        return r

    monkeypatch.setitem(bs.PROTOCOLS, "sse", fake_send)
    a = args_for("--workload", "mixed", "--num-prompts", "4", "--max-concurrency", "2", "--num-long", "2",
                 "--long-delay", "0.05", "--long-interval", "0.05", "--model", "m", "--input-len", "3",
                 "--long-input-len", "5")
    jobs = bs.make_jobs(a, random.Random(0))
    results, duration = asyncio.run(bs.run_benchmark(a, jobs))
    assert [r.cls for r in results] == [j.cls for j in jobs] and all(r.ok for r in results)
    t0 = min(t for t, _ in sent)  # the first short request
    starts = {id(j): t - t0 for t, j in sent}
    longs = [starts[id(j)] for j in jobs if j.cls == "long"]
    shorts = sorted(starts[id(j)] for j in jobs if j.cls == "short")
    # the long ones go out while the first two short ones hold both slots, the last two shorts after
    assert longs[0] < longs[1] < 0.45 and longs[1] - longs[0] >= 0.04
    assert shorts[1] < 0.2 and shorts[2] >= 0.45
    assert all(r.in_flight == 4 for r in results if r.cls == "long")  # 2 running + 2 waiting
    assert 0.9 < duration < 3.0


def _timed(start: float, ttft: float, itl: list[float], tokens: int | None = None) -> bs.RequestResult:
    r = result("", ttft, itl)
    r.start = start
    if tokens is not None:
        r.output_tokens = tokens
    return r


def test_request_samples_and_throughput_series():
    from tools import bench_plot

    results = [_timed(100.0, 0.5, [0.1, 0.1]), _timed(101.0, 0.2, [0.3], tokens=4), result("", 0.0, [], ok=False)]
    samples = bs.request_samples(results)
    assert samples[0] == {"start_s": 0.0, "ok": True, "cls": "", "output_tokens": 3, "ttft_s": 0.5,
                          "e2el_s": 0.7, "itl_s": [0.1, 0.1]}
    assert samples[1]["start_s"] == 1.0 and samples[2]["ok"] is False and samples[2]["ttft_s"] is None
    run = {"requests": samples}
    times = bench_plot.token_times(run)
    assert [t for t, _ in times] == pytest.approx([0.5, 0.6, 0.7, 1.2, 1.5])
    assert sum(n for _, n in times) == pytest.approx(3 + 4)  # a chunk carries its share of the tokens
    x, y = bench_plot.throughput_series(run, bins=5)
    width = 1.5 / 5
    assert len(x) == 5 and sum(y) * width == pytest.approx(7)
    assert bench_plot.samples(run, "ttft") == pytest.approx([500.0, 200.0])
    assert bench_plot.samples(run, "itl") == pytest.approx([100.0, 100.0, 300.0])
    assert bench_plot.samples({}, "itl") is None and bench_plot.throughput_series({}) == ([], [])


def test_plot_and_compare_write_pngs(tmp_path, monkeypatch, capsys):
    import json

    async def fake_send(client, args, job):
        r = bs.RequestResult(prompt_tokens=job.est_tokens, start=time.perf_counter())
        for _ in range(job.max_tokens):
            await asyncio.sleep(0.002)
            r.got_chunk(time.perf_counter())
        r.output_tokens = job.max_tokens
        r.finish()
        return r

    monkeypatch.setitem(bs.PROTOCOLS, "sse", fake_send)
    runs = []
    for name, n in (("before", 6), ("after", 9)):
        saved, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
        argv = ["--quiet", "--model", "m", "--num-prompts", str(n), "--input-len", "3", "--output-len", "5",
                "--max-concurrency", "3", "--save-json", str(saved), "--plot", str(png)]
        assert bs.main(argv) == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        data = json.loads(saved.read_text())
        assert "requests" not in line and len(data.pop("requests")) == n and data == line
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        runs.append(saved)
    # an older result without per-request timings still compares, through its percentiles
    old = tmp_path / "old.json"
    data = json.loads(runs[0].read_text())
    del data["requests"]
    old.write_text(json.dumps(data))
    out = tmp_path / "cmp.png"
    assert bs.main(["--compare", str(runs[0]), str(runs[1]), str(old), "--plot", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        bs.parse_args(["--compare", str(old)])  # one run is nothing to compare
