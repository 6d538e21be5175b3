"""The model runner's step inputs: persistent block tables written only where they grew, metadata
equal to the list-built one, and decode steps padded to graph batch sizes (through the static
buffers that CUDA graphs replay) with unchanged greedy outputs. The capture itself needs CUDA:
its test runs only where CUDA is."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import StepIndex, build_metadata
from engine.cli import _config_kwargs, build_parser
from engine.config import EngineConfig
from engine.model_runner import DriverStep
from engine.parallel import StepInput
from engine.protocol import SamplingParams as Params
from engine.request import Request
from engine.step_buffers import BlockTables, DecodeGraphs, Staging, decode_buckets, prompt_buckets
from tests.ops_outside import OpsOutside

CPU = dict(device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=256, max_num_seqs=8)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 10000) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def request(rid: str, blocks: list[int]) -> Request:
    r = Request(rid, [5, 6], Params())
    r.block_table = blocks
    return r


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_block_tables_write_only_what_grew():
    t = BlockTables(2, 4, scratch_block=9, device=torch.device("cpu"))
    assert t.table[2].tolist() == [9] * 4  # the scratch row
    a, b = request("a", [3, 4]), request("b", [7])
    rows, at, ids = t.update([a, b])
    assert (rows, at, ids) == ([1, 0], [4, 5, 0], [3, 4, 7])
    t.write(torch.tensor(at), torch.tensor(ids))
    a.block_table.append(5)
    assert t.update([a, b]) == ([1, 0], [6], [5])  # only a's new block
    assert t.update([b, a]) == ([0, 1], [], [])
    b.block_table = [8, 2]  # preempted and readmitted: a new table, written whole
    assert t.update([b]) == ([0], [0, 1], [8, 2])
    # a third request takes the row of one not in the step (a's), never one of the step's
    c = request("c", [6])
    assert t.update([b, c]) == ([0, 1], [4], [6])
    assert t.update([a, c]) == ([0, 1], [0, 1, 2], [3, 4, 5])  # a came back: b's row, whole
    assert t.update([b, a]) == ([1, 0], [4, 5], [8, 2])  # and b: c's


class _General(list):
    """Query lengths that ``StepIndex.build`` cannot tell are all 1: its general path runs."""

    def count(self, value) -> int:
        return -1


@pytest.mark.parametrize("computed", [[5], [7, 3, 3, 9, 0], [9, 7, 3, 3], [2, 2, 2]])
def test_a_decode_only_step_index_is_the_general_ones(computed):
    rows = list(range(10, 10 + len(computed)))[::-1]
    fast = StepIndex.build([1] * len(computed), computed, rows)
    general = StepIndex.build(_General([1] * len(computed)), computed, rows)
    assert fast.tensors.keys() == general.tensors.keys()
    for name, t in general.tensors.items():
        assert torch.equal(fast.tensors[name], t), name
    for field in ("max_decode_len", "max_prefill_len", "mixed", "decode_in_order"):
        assert getattr(fast, field) == getattr(general, field), field


def test_a_requests_draft_rows_stay_together_longest_first():
    """Two requests with drafts (rows on one block table each, one more key a row) and one without: each
    request's rows side by side (the CPU kernel walks their blocks once), groups by their longest row; in
    decode-only steps and mixed ones alike."""
    computed, rows = [100, 101, 102, 101, 102, 103, 50], [0, 0, 0, 1, 1, 1, 2]
    want = [5, 4, 3, 2, 1, 0, 6]  # by length alone: 5, 2, 4, 1, 3, 0, 6 (the requests interleaved)
    fast = StepIndex.build([1] * 7, computed, rows)
    general = StepIndex.build(_General([1] * 7), computed, rows)
    for index in (fast, general):
        assert index.tensors["decode_token_rows"].tolist() == want
        assert index.tensors["decode_seq_lens"].tolist() == [104, 103, 102, 103, 102, 101, 51]
        assert index.max_decode_len == 104
    mixed = StepIndex.build([1] * 7 + [4], computed + [0], rows + [3])  # and a prompt's chunk
    assert mixed.tensors["decode_token_rows"].tolist() == want


def test_an_unsplit_step_index_is_one_prefill_over_every_sequence():
    """``split=False``: the same positions and table rows per token as the split index; one prefill over the step's
    sequences in their order, without the reference's gather indices; decodes alone still a decode step."""
    query_lens, computed, rows = [1, 5, 1, 3, 1], [6, 0, 10, 2, 4], [4, 0, 2, 3, 1]
    split, unsplit = StepIndex.build(query_lens, computed, rows), StepIndex.build(query_lens, computed, rows, False)
    for name in ("positions", "token_table_rows"):
        assert torch.equal(split.tensors[name], unsplit.tensors[name]), name
    t = unsplit.tensors
    assert set(t) == {"positions", "token_table_rows", "prefill_table_rows", "prefill_seq_lens", "prefill_query_start"}
    assert t["prefill_table_rows"].tolist() == rows and t["prefill_seq_lens"].tolist() == [7, 5, 11, 5, 5]
    assert t["prefill_query_start"].tolist() == [0, 1, 6, 7, 10, 11]
    assert (unsplit.max_decode_len, unsplit.max_prefill_len, unsplit.mixed) == (0, 11, False)
    assert StepIndex.build([1, 1], [3, 9], [0, 1], False).max_decode_len == 10


def test_persistent_tables_give_the_list_built_metadata():
    bs = 4
    query_lens, computed = [1, 5, 1, 3], [6, 0, 10, 2]
    lists = [[3, 8], [1, 2], [4, 5, 6], [7, 9]]
    want_pos, want = build_metadata(query_lens, computed, lists, bs, torch.device("cpu"))
    tables = torch.full((6, 8), 99, dtype=torch.int64)  # stale ids past each table are never read
    rows = [5, 0, 2, 3]
    for r, bt in zip(rows, lists, strict=True):
        tables[r, :len(bt)] = torch.tensor(bt)
    pos, got = StepIndex.build(query_lens, computed, rows).metadata(tables, bs)
    assert torch.equal(pos, want_pos) and torch.equal(got.slot_mapping, want.slot_mapping)
    for part in ("decode", "prefill"):
        g, w = getattr(got, part), getattr(want, part)
        for name in vars(w):
            a, b = getattr(g, name), getattr(w, name)
            if name == "block_tables":  # each row as far as its sequence reaches: the rest is never read
                used = torch.arange(a.shape[1])[None, :] < (w.seq_lens[:, None] + bs - 1) // bs
                a, b = a[used], b[:, :a.shape[1]][used]
            assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b), (part, name)


def test_staging_keeps_cpu_tensors_as_they_are():
    x = {"a": torch.arange(3)}
    assert Staging(torch.device("cpu"))(x) is x


def test_a_worker_given_the_drivers_step_gives_its_logits(tiny_llama):
    """A tensor-parallel worker gets rank 0's step as a plain StepInput (its table writes included),
    and writes its own copy of the tables from it."""
    driver_llm, worker_llm = LLM(tiny_llama, **CPU), LLM(tiny_llama, **CPU)
    driver = driver_llm.engine.runner
    reqs = [request("a", [0, 1]), request("b", [2])]
    rows, at, ids = driver.block_tables.update(reqs)
    step = DriverStep([3, 2], [2, 0], [5, 6, 7, 8, 9], [2, 4], rows, at, ids)
    want, _ = driver.forward_step(step)
    worker = worker_llm.engine.runner  # its own cache: the driver's K/V copied in, as a rank holds its own
    for mine, theirs in zip(worker.model.layers, driver.model.layers, strict=True):
        mine.self_attn.attn.k_cache.copy_(theirs.self_attn.attn.k_cache)
        mine.self_attn.attn.v_cache.copy_(theirs.self_attn.attn.v_cache)
    got, _ = worker.forward_step(StepInput.unpack(*_packed(step)))
    assert torch.equal(got, want)
    assert torch.equal(worker.block_tables.table, driver.block_tables.table)


def _packed(step: StepInput) -> tuple[list[int], torch.Tensor]:
    header, payload = step.pack()
    return header.tolist(), payload


@pytest.fixture(scope="module")
def unpadded(tiny_llama) -> list[list[int]]:
    llm = LLM(tiny_llama, **CPU, enforce_eager=True)
    assert llm.engine.runner.graphs is None and not llm.engine.runner.decode_buckets
    return [o.token_ids for o in llm.generate(prompts(7), GREEDY)]


@pytest.mark.parametrize("static", [False, True], ids=["padded", "static-buffers"])
def test_padded_decode_steps_keep_greedy_outputs(tiny_llama, unpadded, static):
    """Decode steps padded to the graph batch sizes; with ``static`` also run through the
    static buffers a CUDA graph replays (captured here as the eager forward itself), its
    attention bound to max_model_len. 7 prompts in 14 blocks: preemption rewrites tables too."""
    llm = LLM(tiny_llama, **{**CPU, "num_kv_blocks": 14}, enforce_eager=True)
    runner = llm.engine.runner
    assert runner.kv_cache.shape[2] == llm.engine.block_manager.num_blocks + 1  # the scratch block
    runner.decode_buckets = decode_buckets(8)
    if static:
        f = runner.facts
        runner.graphs = DecodeGraphs(runner.model, runner.decode_buckets, f.max_model_len, runner.block_tables,
                                     runner.block_size, runner.model_cfg.hidden_size, f.dtype, f.device,
                                     capture=lambda forward: forward)
    decodes, replayed = [], []  # (batch size, real sequences) of decode steps; graph replays
    forward_step, replay = runner.forward_step, runner.graphs.replay if static else None

    def counting_forward(step):
        if max(step.query_lens) == 1:
            decodes.append((len(step.query_lens), len(step.logits_rows)))
        return forward_step(step)

    def counting_replay(inputs, b):
        replayed.append(b)
        return replay(inputs, b)

    runner.forward_step = counting_forward
    if static:
        runner.graphs.replay = counting_replay
    got = [o.token_ids for o in llm.generate(prompts(7), GREEDY)]
    assert got == unpadded
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(n in runner.decode_buckets for n, _ in decodes)
    assert any(real < n for n, real in decodes)  # some were padded
    assert replayed == ([n for n, _ in decodes] if static else [])
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_enforce_eager_flag_reaches_the_config():
    parse = build_parser().parse_args
    assert _config_kwargs(parse(["generate", "--prompt", "x", "--enforce-eager"]))["enforce_eager"] is True
    assert "enforce_eager" not in _config_kwargs(parse(["generate", "--prompt", "x"]))
    assert EngineConfig().enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")
    assert _config_kwargs(parse(["serve", "--prompt-graph-tokens", "0"]))["prompt_graph_tokens"] == 0
    assert EngineConfig().prompt_graph_tokens == 2048
    for bad in (-1, 1.5, "all"):
        with pytest.raises(ValueError, match="prompt_graph_tokens"):
            EngineConfig(prompt_graph_tokens=bad)


def test_prompt_buckets_pad_by_a_third_at_most():
    sizes = prompt_buckets(2048)
    assert sizes[:8] == [16, 24, 32, 48, 64, 96, 128, 192] and sizes[-1] == 2048
    assert all(b > a and b <= a * 3 // 2 for a, b in zip(sizes, sizes[1:], strict=False))
    assert prompt_buckets(40) == [16, 24, 32, 40] and prompt_buckets(10) == [10]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_prompt_graphs_make_their_metadata_and_keep_greedy_outputs(tiny_llama, monkeypatch, overlap):
    """Steps with prompt tokens (chunks beside decodes, one prefill over all of them) replayed through
    ``PromptGraphs`` (each capture here the eager forward itself, which is all a graph reads): padded to
    a token count with a sequence of its own, the same greedy tokens as eager steps, with preemption, and
    with tokens in flight (asynchronous scheduling: read from last_tokens inside the graph). Outside the
    replay a step runs the block tables' write, the copy of its inputs (one buffer) and the LM head's
    gather: the slot mapping and the block tables are made inside."""
    import kernels

    monkeypatch.setattr(kernels, "prefill_takes_decodes", lambda *args: True)  # (as Triton's, on CUDA)
    kw = dict(CPU, num_kv_blocks=14, max_num_batched_tokens=40, enforce_eager=True, async_scheduling=overlap)
    want = [o.token_ids for o in LLM(tiny_llama, **kw).generate(prompts(7), GREEDY)]
    llm = LLM(tiny_llama, **kw)
    runner, ops = llm.engine.runner, OpsOutside()
    runner._capture_prompt_graphs(lambda forward: forward, 40)
    graphs = runner.prompt_graphs
    assert graphs.sizes == [16, 24, 32, 40]
    graphs.replays = {n: ops.quiet(replay) for n, replay in graphs.replays.items()}
    runner.model.compute_logits = ops.quiet(runner.model.compute_logits)
    runner.forward_step = ops.steps_of(runner.forward_step, lambda step: len(step.token_ids) > len(step.query_lens))
    with ops:
        got = [o.token_ids for o in llm.generate(prompts(7), GREEDY)]
    assert got == want and llm.engine.scheduler.num_preemptions > 0
    replayed = [step for step in ops.steps if step]
    assert len(replayed) >= 5
    assert all(sorted(step) in (["copy_", "index", "index_put_"], ["copy_", "index_put_"]) for step in replayed), replayed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graphs_keep_greedy_outputs(tiny_llama):
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_seqs=8)
    eager = LLM(tiny_llama, enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    want = [o.token_ids for o in eager.generate(prompts(7), GREEDY)]
    llm = LLM(tiny_llama, **kw)
    assert sorted(b for b, _ in llm.engine.runner.graphs.replays) == decode_buckets(8)
    assert [o.token_ids for o in llm.generate(prompts(7), GREEDY)] == want


def test_prompt_logprobs_in_flight_are_not_computed_twice(tiny_llama):
    """Asynchronous scheduling: a request with prompt logprobs is preempted while a chunk's logprobs are
    still on the device, and readmitted (recomputing from position 0) before that step is collected. The
    positions already on their way are not computed again, so each comes back once, in order."""
    from engine.scheduler import ScheduledBatch

    runner = LLM(tiny_llama, **CPU).engine.runner
    r = Request("r", list(range(10, 50)), Params(prompt_logprobs=1, max_tokens=1))
    r.block_table = [0, 1, 2]
    first = ScheduledBatch()
    first.add(r, 16)
    in_flight = runner.launch(first)  # positions 0..15
    assert r.prompt_logprobs_end == 17
    r.block_table = [3, 4, 5]  # preempted (a new table) and readmitted from position 0
    again = ScheduledBatch()
    again.add(r, 24)
    second = runner.launch(again)  # recomputes 0..23: logprobs only for 16..23
    for launched in (in_flight, second):
        runner.collect(launched)
    assert len(r.prompt_logprobs) == 1 + 24 and r.num_prompt_logprobs_in_flight == 0
    whole = LLM(tiny_llama, **CPU).generate([r.prompt_token_ids], Params(prompt_logprobs=1, max_tokens=1))[0]
    for got, want in zip(r.prompt_logprobs[1:], whole.prompt_logprobs[1:25], strict=True):
        assert got[0] == pytest.approx(want[0], abs=1e-5)


def test_logits_come_in_the_models_dtype(tiny_llama):
    """A bf16 model's logits stay bf16 (no float32 copy of every row's vocabulary written and read again for
    a greedy step's argmax); its greedy tokens are the argmax of those logits."""
    llm = LLM(tiny_llama, **{**CPU, "dtype": "bfloat16"})
    runner, seen = llm.engine.runner, []
    real = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: seen.append(real(hidden)) or seen[-1]
    out = llm.generate([prompts(1)[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert seen and all(x.dtype == torch.bfloat16 for x in seen)
    assert out.token_ids == [int(x[-1].float().argmax()) for x in seen]
