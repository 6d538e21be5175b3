"""CPU graphs (``kernels.cpu.graph``): a forward recorded as its C kernel calls and torch operators,
replayed on new input data with the results of running it again; decode steps through them keep
the engine's greedy outputs; what cannot be recorded turns them off and still computes the step."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.model_runner as model_runner
from engine import LLM, SamplingParams
from engine.model_runner import DriverStep
from kernels import cpu
from kernels import reference as kernels_ref
from kernels.cpu import graph
from tests.conftest import make_tiny_model
from tests.ops_outside import OpsOutside
from tests.test_model_runner import prompts, request

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
needs_c = pytest.mark.skipif(not cpu.available(), reason="needs the C kernels (a C compiler)")


@needs_c
def test_a_recording_replays_c_calls_and_torch_operators_on_new_data():
    torch.manual_seed(0)
    x, rows = torch.randn(8, 16), torch.tensor([4, 0, 2])  # static inputs
    w, cache = torch.randn(16), torch.zeros(8, 16)
    out = {}

    def forward():
        h = cpu.rms_norm(x.t().contiguous().t().contiguous() * 2, w, 1e-6)  # a copy the schema calls a view
        picked = h.index_select(0, rows)
        cache.index_copy_(0, rows, picked)  # in place, into memory the recording does not own
        out["y"] = cpu.silu_and_mul(torch.cat([picked, picked + 1], dim=1)).add_(1.0)

    replay = graph.capture()(forward)
    y = out["y"]
    x.copy_(torch.randn(8, 16))
    rows.copy_(torch.tensor([1, 7, 3]))
    cache.zero_()
    replay()
    got_y, got_cache = y.clone(), cache.clone()
    cache.zero_()
    forward()  # eagerly, on the same new data
    assert torch.equal(got_y, out["y"]) and torch.equal(got_cache, cache)
    assert got_cache[[1, 7, 3]].abs().sum() > 0 and not graph.recording()


@needs_c
def test_a_run_of_c_calls_is_replayed_from_c_and_a_failing_one_raises_its_own_error():
    """Consecutive C calls replay as one call into graph.c, with the packed arguments (a float among
    them), and a status that is not 0 raises what the failing kernel's own check says."""
    torch.manual_seed(0)
    x, w, slots = torch.randn(2, 16), torch.randn(16), torch.tensor([0, 3])
    kc, vc = torch.zeros(4, 1, 2, 8), torch.zeros(4, 1, 2, 8)
    out = {}

    def forward():
        h = cpu.rms_norm(x, w, 1e-3)
        cpu.store_kvcache(h.view(2, 2, 8), h.view(2, 2, 8), kc, vc, slots)
        out["y"] = cpu.silu_and_mul(h)

    replay = graph.capture()(forward)
    assert graph._executor() is not None
    x.copy_(torch.randn(2, 16))
    replay()
    plan = replay.__self__._plan
    assert len(plan) == 1 and isinstance(plan[0], graph._Run) and len(plan[0].calls) == 3
    h = kernels_ref.rms_norm(x, w, 1e-3)
    torch.testing.assert_close(out["y"], kernels_ref.silu_and_mul(h), rtol=1e-6, atol=1e-6)
    assert torch.equal(kc[3, 0].flatten(), h[1])
    slots[1] = 4  # past the cache: store_kv refuses it
    with pytest.raises(IndexError, match="the C attention kernel was given an index out of range"):
        replay()
    assert any(any(t is kc for t in held) for held in replay.__self__.held)  # the caches it writes into, kept


@needs_c
def test_a_recording_keeps_only_its_own_threads_calls():
    """Another thread's kernels, run while this one records, are neither recorded (their tensors are not
    the recording's to keep) nor told to skip their checks."""
    w, inside, done, seen = torch.ones(64), threading.Event(), threading.Event(), {}

    def forward():
        inside.set()
        done.wait(10)

    def other():
        inside.wait(10)
        seen["recording"] = graph.recording()
        cpu.rms_norm(torch.randn(4, 64), w, 1e-6)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    replay = graph.capture()(forward)
    t.join()
    assert seen == {"recording": False} and replay.__self__.steps == []


def test_a_read_on_the_host_cannot_be_recorded():
    x = torch.ones(3)
    with pytest.raises(graph.NotReplayable, match="host"):
        graph.capture()(lambda: int(x.sum()))
    assert not graph.recording()


@needs_c
@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen2", "float32"), ("qwen3", "float32"),
                                        ("llama", "bfloat16")])
def test_cpu_graphs_keep_greedy_outputs(arch, dtype, tiny_llama, tmp_path, smollm_tokenizer_dir, monkeypatch):
    """7 prompts in 14 blocks (preemptions), steps of 1 to 7 sequences: those of up to 4 replay, the
    rest run eagerly, and recordings of 6 rows in all are kept (older ones dropped, recorded again).
    Qwen3's per-head norms copy q and k out of the fused projection: those copies are replayed too."""
    model = tiny_llama if arch == "llama" else make_tiny_model(str(tmp_path / arch), arch, smollm_tokenizer_dir)
    kw = dict(device="cpu", dtype=dtype, num_kv_blocks=14, max_model_len=256, max_num_seqs=8)
    want = [o.token_ids for o in LLM(model, enforce_eager=True, **kw).generate(prompts(7), GREEDY)]
    monkeypatch.setattr(model_runner, "CPU_GRAPH_SEQS", 4)
    monkeypatch.setattr(model_runner, "CPU_GRAPH_ROWS", 6)
    llm = LLM(model, **kw)
    graphs = llm.engine.runner.graphs
    captured, replayed, capture, replay = [], [], graphs.capture, graphs.replay

    def counting_capture(forward):
        captured.append(forward.args[0])
        return capture(forward)

    def counting_replay(inputs, b):
        replayed.append(b)
        return replay(inputs, b)

    graphs.capture, graphs.replay = counting_capture, counting_replay
    for _ in range(2):  # the second time, sizes dropped the first time are recorded again
        assert [o.token_ids for o in llm.generate(prompts(7), GREEDY)] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert set(replayed) == {1, 2, 3, 4} and len(replayed) > len(captured)  # most steps replayed a recording
    assert len(captured) > len(set(captured))  # some were dropped and recorded again
    assert sum(b for b, _ in graphs.replays) <= 6


def test_no_cpu_graphs_where_decode_attention_is_the_references(tmp_path, smollm_tokenizer_dir):
    """Heads of 12 are not the C kernel's: the reference would gather every context to max_model_len."""
    model = make_tiny_model(str(tmp_path), "llama", smollm_tokenizer_dir, hidden_size=48)
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=256, max_num_seqs=8)
    assert llm.engine.runner.model_cfg.head_dim == 12 and llm.engine.runner.graphs is None


@needs_c
def test_a_forward_that_cannot_be_recorded_runs_eagerly(tiny_llama, caplog):
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=256, max_num_seqs=8)
    want = [o.token_ids for o in LLM(tiny_llama, enforce_eager=True, **kw).generate(prompts(3), GREEDY)]
    llm = LLM(tiny_llama, **kw)
    graphs = llm.engine.runner.graphs
    model = graphs.model

    def reads_its_input(ids, positions, meta):
        int(ids.sum())  # data-dependent: not replayable
        return model(ids, positions, meta)

    graphs.model = reads_its_input
    with caplog.at_level(logging.WARNING, "tokenmill.engine"):
        assert [o.token_ids for o in llm.generate(prompts(3), GREEDY)] == want
    assert "decode graphs off" in caplog.text and "NotReplayable" in caplog.text
    assert not graphs.replays and not graphs.serves(1)


@needs_c
def test_a_replayed_decode_step_makes_its_metadata_inside_the_graph(tiny_llama):
    """Outside a decode graph's replay, a decode step runs only the block tables' write and the copy of its
    inputs (tokens, positions, rows of the block tables: one buffer): the slot mapping, the step's block
    tables and its lengths are made inside the graph, and the rows the LM head reads are a slice of its
    output. (On CUDA each operator outside is a launch the host pays for, and a small kernel between two
    graphs.)"""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=256, max_num_seqs=8)
    runner, graphs, ops = llm.engine.runner, llm.engine.runner.graphs, OpsOutside()
    capture = graphs.capture
    graphs.capture = lambda forward: ops.quiet(ops.quiet(capture)(forward))  # (a capture runs the forward too)
    runner.model.compute_logits = ops.quiet(runner.model.compute_logits)  # (the LM head: the model's, after the graph)
    runner.forward_step = ops.steps_of(runner.forward_step, lambda step: len(step.token_ids) == len(step.query_lens)
                                       and graphs.serves(len(step.token_ids)))
    with ops:
        llm.generate(prompts(3), GREEDY)
    replayed = [step for step in ops.steps if step]
    assert len(replayed) >= 15
    assert all(sorted(step) == ["copy_", "index_put_"] for step in replayed), replayed


@needs_c
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_decode_graph_reads_tokens_in_flight_only_under_asynchronous_scheduling(tiny_llama, overlap):
    """A decode graph takes a row's token from ``last_tokens`` (where it is -1: in flight) only where a token can
    be in flight, under asynchronous scheduling: a synchronous engine's graphs leave out those operators (three
    kernels a step on CUDA, its prompt graphs alike) and give the same tokens."""
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=256, max_num_seqs=8)
    want = [o.token_ids for o in LLM(tiny_llama, enforce_eager=True, **kw).generate(prompts(3), GREEDY)]
    llm = LLM(tiny_llama, async_scheduling=overlap, **kw)
    graphs, recorded = llm.engine.runner.graphs, []
    forward = graphs._forward

    def recording(b):  # (what a capture runs)
        with OpNames() as names:
            forward(b)
        recorded.append(names.seen)

    graphs._forward = recording
    assert [o.token_ids for o in llm.generate(prompts(3), GREEDY)] == want
    assert recorded and all(("where" in ops) == (overlap == "on") for ops in recorded)


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_replayed_decode_step_gives_the_logits_rows_it_is_asked_for(tiny_llama):
    """A replayed decode step hands the LM head a slice of its rows when its logits rows are its first ones,
    and gathers them when not (a step whose last sequence is an embedding's 1-token chunk, say): the same
    logits as the eager forward in both cases."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=256, max_num_seqs=8)
    runner = llm.engine.runner
    rows, at, ids = runner.block_tables.update([request("a", [1]), request("b", [2]), request("c", [3])])
    for logits_rows in ([0, 1, 2], [0, 1], [0, 2], [2, 0]):
        step = DriverStep([1, 1, 1], [3, 5, 7], [11, 12, 13], logits_rows, rows, at, ids)
        replayed, _ = runner.forward_step(step)
        graphs, runner.graphs = runner.graphs, None
        try:
            eager, _ = runner.forward_step(step)
        finally:
            runner.graphs = graphs
        assert runner.graphs.replays and torch.allclose(replayed, eager, atol=1e-5), logits_rows
