"""What of the GPU tools runs without a GPU: ``tools/gpu_check.sh``'s argument handling, the random-weight
model builder (``tools/random_model.py``) at tiny sizes, ``tools/bench_kernels.py`` saying that
there is nothing to time, its cases run at tiny sizes through Triton's interpreter, and
``tools/bench_host.py``'s table of a decode step's host work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import kernels
from engine import LLM, SamplingParams
from tools.random_model import SHAPES, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, initializer_range=0.08)


@pytest.mark.parametrize("args", [[], ["a", "b"], [""]])
def test_gpu_check_wants_one_outdir(args):
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), *args], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("usage: tools/gpu_check.sh OUTDIR")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_random_model_loads_in_transformers_and_in_tokenmill(arch, tmp_path):
    path = build(str(tmp_path), arch, torch.float32, seed=3, **TINY)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode("Hello, world: 1 + 1 = 2")
    assert tok.decode(ids) == "Hello, world: 1 + 1 = 2" and max(ids) < TINY["vocab_size"]
    assert tok.decode(list(range(3, TINY["vocab_size"]))) != ""  # every id decodes

    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=128)
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(4):  # greedy, EOS ignored as tokenmill was asked to
            seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert out.token_ids == seq[0, len(ids):].tolist()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_are_the_real_models(name):
    arch, config = SHAPES[name]
    cfg = AutoConfig.for_model(arch, **config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads = {"smollm2-135m": (9, 3, 64), "smollm2-1.7b": (32, 32, 64), "qwen2-0.5b": (14, 2, 64), "qwen3-0.6b": (16, 8, 128),
             "qwen3-moe-tiny": (16, 4, 64), "gemma3-270m": (4, 1, 256), "bge-small": (12, 12, 32),
             "gpt-oss-tiny": (32, 4, 64)}[name]
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)  # (BERT's: every head its own)
    assert (cfg.num_attention_heads, kv_heads, head_dim) == heads


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run the whole benchmark")
def test_bench_kernels_without_cuda_has_nothing_to_time():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_kernels.py")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "nothing to time" in r.stdout
    assert json.loads(r.stdout.splitlines()[-1]) == {"device": "cpu", "nothing_to_time": True, "results": []}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernels' own tests and the benchmark run them")
def test_bench_kernels_cases_run_through_the_interpreter(monkeypatch):
    """Every case ``tools/bench_kernels.py`` would time, built at tiny sizes on the CPU and run once, Triton's and
    torch's alike: a GPU session's benchmark does not fail on its own code."""
    from tools import bench_kernels as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setitem(bench.MODELS, "tiny", (4, 2, 64, 256))
    layers = (("moe", 64, 4, 32, 2, None), ("moe-mxfp4", 64, 4, 64, 2, "mxfp4"))
    cases = [*bench.cases("tiny", 2, [24, 40], (2, 8)), *bench.moe_cases(3, 8, layers)]
    kinds = {c.kernel for c in cases}
    assert {"paged_decode_attention", "paged_prefill_attention", "linear_packed q4_z", "linear_packed q4_k",
            "fused_moe", "fused_moe mxfp4"} <= kinds
    assert any(c.shape.startswith("mixed:") for c in cases)
    assert {c.shape for c in cases if c.shape.startswith("launch:")} == {
        f"launch: ctx=24 w{w} n{n}" for w, n in bench.LAUNCHES}
    for c in cases:
        assert c.nbytes > 0
        out = c.triton()
        if c.shape.startswith("mixed:"):  # (both sides Triton's: the same rows)
            torch.testing.assert_close(out, c.torch())
        if c.shape.startswith("launch:"):  # (another launch: the keys summed in other tiles, bf16)
            torch.testing.assert_close(out, c.torch(), atol=2e-2, rtol=2e-2)
        c.torch()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the benchmark runs them")
def test_bench_kernels_sampler_steps_run_on_the_cpu(monkeypatch):
    """The sampler's steps ``tools/bench_kernels.py`` times, at a tiny vocabulary on the CPU: one id a row, within
    the vocabulary, the greedy ones the argmax."""
    from tools import bench_kernels as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    steps = dict(bench.sampler_steps(3, vocab=50))
    assert set(steps) == set(bench.SAMPLING) >= {"greedy", "top_p", "seeded_top_p"}
    for kind, step in steps.items():
        ids = step()
        assert ids.shape == (3,) and 0 <= int(ids.min()) and int(ids.max()) < 50, kind
    assert torch.equal(steps["seeded_top_p"](), steps["seeded_top_p"]())  # (a seed: the same ids again)


def test_profile_steps_counts_each_kernel_once_on_cuda(capsys):
    """``decode_breakdown`` on CUDA: the kernels' device time alone (an eager operator's row holds its kernel's
    time too, and a user annotation spans others'), in µs a step."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from tools.profile_steps import decode_breakdown

    def event(key, device_type, us, annotation=False):
        return SimpleNamespace(key=key, count=5, device_type=device_type, self_device_time_total=us,
                               self_cpu_time_total=7.0, is_user_annotation=annotation)

    table = [event("aten::mm", DeviceType.CPU, 500.0), event("sm90_gemm_kernel", DeviceType.CUDA, 500.0),
             event("_decode_kernel", DeviceType.CUDA, 250.0), event("step", DeviceType.CUDA, 900.0, True)]
    top = decode_breakdown(table, 5, 10, cuda=True)
    assert top == [["sm90_gemm_kernel", 100.0], ["_decode_kernel", 50.0]]
    assert "150 us a step in all" in capsys.readouterr().out


def test_bench_kernels_reads_graphed_times_where_the_capture_works(monkeypatch, capsys):
    """``tools/bench_kernels.py``'s report, its timers faked: eager times for every case, CUDA-graph replays for
    the dense ones (the mixture-of-experts layers are not captured), ``bw`` and the ratios from the graphed times
    where both sides were captured, the eager ones where a capture failed."""
    import triton.testing

    from tools import bench_kernels as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setitem(bench.MODELS, "tiny", (4, 2, 64, 256))
    small = (("moe", 64, 4, 32, 2, None),)
    real_moe = bench.moe_cases
    monkeypatch.setattr(bench, "moe_cases", lambda batch, tokens: real_moe(batch, tokens, small))
    monkeypatch.setattr(bench, "measure_bandwidth", lambda device, nbytes: 1e12)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench, "VOCAB", 64)
    graphed = []

    def do_bench(fn, return_mode):  # 1 ms a call, eager
        return 1.0

    def do_bench_cudagraph(fn, rep, return_mode):  # 0.25 ms replayed; the decode's launch cases cannot be captured
        graphed.append(fn)
        if len(graphed) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.25

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", do_bench_cudagraph)
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--models", "tiny", "--batch", "2", "--contexts", "24,40",
                                      "--prefill", "2x8"])
    bench.main()
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    rows = report["results"]
    assert "no CUDA graph, RuntimeError" in out
    first, moe = rows[0], [r for r in rows if r["kernel"].startswith("fused_moe")]
    assert first["graphed_us"] is None and first["torch_over_triton"] == 1.0  # (its capture failed: eager times)
    assert moe and all(r["graphed_us"] is None for r in moe)  # (never captured)
    dense = [r for r in rows[1:] if not r["kernel"].startswith("fused_moe")]
    assert dense and all(r["graphed_us"] == 250.0 and r["torch_graphed_us"] == 250.0 for r in dense)
    assert all(r["bw_fraction"] == round(r["floor_us"] / 250.0, 3) for r in dense)
    assert report["decode_best_launch"]["default_over_it"] == 1.0
    assert report["sampler_us"] == {kind: 1000.0 for kind in bench.SAMPLING}  # (1 ms a step, faked)
    assert all(r["torch_us"] == 1000.0 and r["floor_us"] == round(2 * 64 * 2 / 1e12 * 1e6, 1)
               for r in report["sampler"].values())
    assert kernels.backend() == "auto"  # (the torch path's timing put it back)


def bench_host(*flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``tools/bench_host.py FLAGS``, run to its end: the run and its last line's JSON."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_host.py"), *flags],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_host_times_each_stage_of_a_decode_step_side_by_side():
    """``tools/bench_host.py``: the host's part of each stage per decode step, the model stubbed out; with
    ``--before`` another checkout (here this one again) timed in turns with this one; ``--waiting``: a full
    server's steps (requests wait behind the full seats, never admitted while timed); ``--logprobs``: every
    request asks for its top logprobs. Beside the step, the actor's frame of its outputs and a frontend's
    reading of it."""
    r, out = bench_host("--num-seqs", "8", "--steps", "3", "--rounds", "1", "--sampling", "seeded", "--before", ROOT,
                        "--turns", "1", "--waiting", "5", "--scheduling-policy", "priority", "--logprobs", "5")
    assert (out["waiting"], out["scheduling_policy"], out["logprobs"]) == (5, "priority", 5)
    assert "8 sequences, 5 waiting" in r.stdout and "top 5 logprobs" in r.stdout
    for name in ("this", "before"):
        stages = out[name]
        assert set(stages) == {"schedule", "prepare", "forward_step", "model", "sample", "postprocess", "step",
                               "encode", "decode"}
        # the stages are parts of the step; the frame's are not
        assert 0 < stages["schedule"]["min_us"] + stages["postprocess"]["min_us"] < stages["step"]["median_us"]
        assert stages["encode"]["min_us"] > 0 and stages["decode"]["min_us"] > 0
    assert "this checkout's minimum is" in r.stdout


def test_bench_host_times_an_eager_step_with_its_kernels_stubbed_out():
    _, out = bench_host("--eager-layers", "3", "--num-seqs", "8", "--steps", "3", "--rounds", "1")
    assert out["eager_layers"] == 3 and "before" not in out
    stages = out["this"]
    # the model's forward ran (its launches and GEMMs stubbed), inside forward_step
    assert 0 < stages["model"]["min_us"] < stages["forward_step"]["min_us"] < stages["step"]["min_us"]


def test_bench_host_times_steps_with_prompts_replayed_through_prompt_graphs():
    r, out = bench_host("--prompt-graphs", "--num-seqs", "8", "--steps", "3", "--rounds", "1")
    assert out["prompt_graphs"] is True and "two 128-token prompts, prompt graphs" in r.stdout
    stages = out["this"]
    # every timed step carried prompts and replayed a (stubbed) prompt graph: the model's forward never ran
    assert stages["model"]["median_us"] == 0 < stages["forward_step"]["min_us"] < stages["step"]["min_us"]


def test_bench_host_times_steps_beside_a_queue_of_long_prompts():
    r, out = bench_host("--waiting", "3", "--long-queue", "--num-seqs", "4", "--steps", "3", "--rounds", "1")
    assert out["long_queue"] is True and "3 waiting 4000-token prompts with seats free" in r.stdout
    # every timed step carried a prompt chunk: eager, through the (stubbed) model, not a decode graph
    assert 0 < out["this"]["model"]["min_us"] < out["this"]["forward_step"]["min_us"]


def test_profile_steps_times_and_profiles_steps_with_prompts(tmp_path):
    """``tools/profile_steps.py`` (run by tools/gpu_check.sh): both kinds of step timed, the profiles printed."""
    path = build(str(tmp_path), "llama", torch.float32, seed=3, **TINY)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "profile_steps.py"), "--model", path,
                        "--num-seqs", "4", "--join", "2", "--prompt-len", "8", "--steps", "4", "--profile",
                        "--rows", "3", "--prompt-graph-tokens", "0"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["num_seqs"] == 4 and out["decode_step_ms"] > 0 and out["prompt_step_ms"] > 0
    assert out["prompt_graphs"] is False and "steps with prompts eager" in r.stdout
    assert "operators by host (self) time" in r.stdout and "Python functions by tottime" in r.stdout
    assert "5 decode-only steps: operators by host time" in r.stdout
    assert out["decode_top"] and all(isinstance(name, str) and us > 0 for name, us in out["decode_top"])
