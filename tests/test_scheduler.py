"""Scheduler: token budgets, chunked prefill, admission, preemption, with exact block ids."""

import pytest

from engine.block_manager import BlockManager
from engine.protocol import SamplingParams
from engine.request import Request, Status
from engine.scheduler import QueueFull, Scheduler


def make(num_blocks=8, block_size=4, max_num_seqs=4, max_tokens=100, max_waiting=16, **kw):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, max_tokens, max_waiting, **kw), bm


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=50))


def run_step(s: Scheduler, batch) -> None:
    """What the engine does after the model ran: advance, and sample where the prompt is done."""
    for r, n in zip(batch.requests, batch.num_new_tokens, strict=True):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)


def test_prefill_then_decode_one_token_each():
    s, bm = make()
    a, b = req("a", 5), req("b", 3)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"]
    assert batch.num_new_tokens == [5, 3]
    assert a.block_table == [0, 1] and b.block_table == [2]
    run_step(s, batch)
    batch = s.schedule()
    assert batch.num_new_tokens == [1, 1]  # decode: the one sampled token each
    assert a.block_table == [0, 1] and b.block_table == [2]  # the new tokens still fit
    assert s.running == [a, b] and not s.waiting


def test_chunked_prefill_under_a_token_budget():
    s, bm = make(max_tokens=4)
    a, b = req("a", 10), req("b", 2)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.num_new_tokens == [4] and batch.requests == [a]
    run_step(s, batch)
    batch = s.schedule()
    assert batch.requests == [a] and batch.num_new_tokens == [4]
    run_step(s, batch)
    batch = s.schedule()  # a's last 2 prompt tokens, then b fits in the remaining budget
    assert batch.requests == [a, b] and batch.num_new_tokens == [2, 2]
    assert a.block_table == [0, 1, 2] and b.block_table == [3]


def test_sequence_budget_limits_admission():
    s, _ = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(str(i), 2))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2"]


def test_waiting_request_waits_for_blocks():
    s, bm = make(num_blocks=3, block_size=4)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.requests == [a] and a.block_table == [0, 1]
    assert b.status is Status.WAITING and b.block_table == []


def test_preempts_the_most_recently_admitted_and_resumes_it():
    s, bm = make(num_blocks=4, block_size=2)
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    run_step(s, batch)  # both now have 5 tokens, 4 computed: each needs a third block
    batch = s.schedule()
    assert batch.preempted == [b]
    assert batch.requests == [a] and a.block_table == [0, 1, 3]  # b's blocks freed tail first: 3, 2
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    assert list(bm.free_block_ids) == [2]
    run_step(s, batch)
    s.finish(a, "stop")
    assert bm.num_free_blocks == 4
    batch = s.schedule()  # b is recomputed: its prompt and its sampled token
    assert batch.requests == [b] and batch.num_new_tokens == [5]


def test_finish_frees_blocks_and_removes_from_queues():
    s, bm = make()
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a, "abort")
    assert a.status is Status.FINISHED and a.finish_reason == "abort"
    assert s.running == [b]
    c = req("c", 2)
    s.add(c)
    s.finish(c, "abort")
    assert not s.waiting
    s.finish(b, "stop")
    assert bm.num_free_blocks == bm.num_blocks and not s.has_work()


def test_bounded_waiting_queue():
    s, _ = make(max_waiting=2)
    s.add(req("a", 1))
    s.add(req("b", 1))
    with pytest.raises(QueueFull):
        s.add(req("c", 1))


def test_one_at_a_time_admits_one_request_only_when_every_running_one_decodes():
    s, _ = make(num_blocks=16, max_tokens=8)
    s.one_at_a_time = True
    a, b, c = req("a", 10), req("b", 2), req("c", 2)
    for r in (a, b, c):
        s.add(r)
    steps = []
    for _ in range(4):
        batch = s.schedule()
        steps.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)])
        run_step(s, batch)
    assert steps == [[("a", 8)], [("a", 2)],  # nobody joins while a's prompt is computed
                     [("a", 1), ("b", 2)], [("a", 1), ("b", 1), ("c", 2)]]
    s.one_at_a_time = False
    d, e = req("d", 2), req("e", 2)
    s.add(d)
    s.add(e)
    assert s.schedule().requests == [a, b, c, d]  # as many as max_num_seqs allows again


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_one_at_a_time_holds_back_a_priority_preemption_while_a_prompt_is_computed(one_at_a_time):
    s, _ = make(num_blocks=16, max_num_seqs=1, max_tokens=8, policy="priority")
    s.one_at_a_time = one_at_a_time
    a, b = Request("a", list(range(1, 11)), SamplingParams(max_tokens=50), priority=5), req("b", 2)
    s.add(a)
    run_step(s, s.schedule())  # a's first 8 prompt tokens
    s.add(b)  # priority 0: would push a out for the only sequence slot
    batch = s.schedule()
    if one_at_a_time:
        assert batch.requests == [a] and not batch.preempted and list(s.waiting) == [b]
    else:
        assert batch.requests == [b] and batch.preempted == [a]


def test_embeddings_do_not_size_the_prefill_cap_beside_streams():
    """One stream decoding, embedding requests waiting: a step's prompt tokens are capped for a batch of
    one decode (the embeddings never decode), not for the max_num_seqs their number would suggest."""
    from types import SimpleNamespace

    from engine.prefill_cap import PrefillCap

    asked = []

    class Cap(PrefillCap):
        def value(self, rows: int) -> int:
            asked.append(rows)
            return 4

    s, _ = make(num_blocks=64, max_num_seqs=8, prefill_cap=Cap(100))
    stream = req("g", 2)
    s.add(stream)
    run_step(s, s.schedule())
    docs = [Request(f"e{i}", list(range(1, 11)), SamplingParams(max_tokens=1), pool=SimpleNamespace(uncached=False, whole=False))
            for i in range(6)]
    for d in docs:
        s.add(d)
    batch = s.schedule()
    assert asked == [1] and batch.requests == [stream, docs[0]] and batch.num_new_tokens == [1, 4]
    s.add(req("g2", 3))  # a generation waiting will decode: it counts
    run_step(s, batch)
    s.schedule()
    assert asked[-1] == 2  # the stream and g2; not docs[0], running (prefilling) but never decoding


def test_an_embeddings_last_prompt_token_is_a_prompt_token():
    """A 5-token embedding under a 4-token budget: its fifth token is not a decode (it samples nothing), so
    the step it is in has no decodes and is not capped."""
    from types import SimpleNamespace

    s, _ = make(max_tokens=4)
    doc = Request("e", list(range(1, 6)), SamplingParams(max_tokens=1), pool=SimpleNamespace(uncached=False, whole=False))
    s.add(doc)
    s.add(req("late", 3))
    batch = s.schedule()
    assert batch.requests == [doc] and batch.num_new_tokens == [4]
    run_step(s, batch)
    batch = s.schedule()
    assert batch.requests == [doc, s.running[1]] and batch.num_new_tokens == [1, 3] and batch.num_decodes == 0


def image_req(rid: str, n: int, images: list[tuple[int, int]]) -> Request:
    from engine.request import PromptImage

    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=50),
                   images=[PromptImage(o, length, (3, 1, 1), b"", rid.encode()) for o, length in images])


def test_an_image_a_chunk_begins_counts_its_positions_against_the_step():
    from engine.prefill_cap import PrefillCap

    s, _ = make(num_blocks=64, max_tokens=100, prefill_cap=PrefillCap(100, fixed=100))  # (no cap beside decodes)
    a, b = image_req("a", 60, [(5, 40)]), image_req("b", 60, [(5, 40)])
    s.add(a)
    s.add(b)
    batch = s.schedule()  # a's 60 tokens and its image's 40 positions fill the step: b's image waits
    assert (batch.requests, batch.num_new_tokens, batch.image_tokens) == ([a], [60], 40)
    run_step(s, batch)
    a.image_embeds[0] = "encoded"  # (the runner keeps it while chunks still need it)
    batch = s.schedule()  # a decodes; b's 59 tokens and its image in the 99 left
    assert (batch.requests, batch.num_new_tokens, batch.image_tokens) == ([a, b], [1, 59], 40)
    # a chunk stops before an image that does not fit; one larger than a step's budget still gets a step alone
    s, _ = make(num_blocks=64, max_tokens=30, prefill_cap=PrefillCap(30, fixed=30))
    c, d = req("c", 20), image_req("d", 60, [(5, 40), (50, 4)])
    s.add(c)
    s.add(d)
    batch = s.schedule()
    assert (batch.requests, batch.num_new_tokens, batch.image_tokens) == ([c, d], [20, 5], 0)
    run_step(s, batch)
    batch = s.schedule()  # c decodes: d's image alone, with its first token
    assert (batch.requests, batch.num_new_tokens, batch.image_tokens) == ([c, d], [1, 1], 40)
    run_step(s, batch)
    d.image_embeds[0] = "encoded"
    batch = s.schedule()  # the rest of the first image, up to the second, which waits: 29 tokens would not fit it
    assert (batch.num_new_tokens, batch.image_tokens) == ([1, 29], 0)
