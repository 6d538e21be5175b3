"""The sliding-window layers' own KV pool (engine.window_blocks): its bookkeeping, its sizing, and that
it never changes greedy output (Gemma 3's mix of sliding and full layers, Mistral's all-sliding)."""

import json
import os
import types

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import Request
from engine.runtime import count_kv_blocks, kv_block_bytes
from tests.conftest import make_tiny_model

# ---------------------------------------------------------------------------------------- bookkeeping

BS, W = 4, 8  # a query at position p reads positions p - 7 onward: two blocks back


def req(tokens: list[int] | int, rid: str = "r") -> Request:
    return Request(rid, list(range(tokens)) if isinstance(tokens, int) else tokens, SamplingParams())


def run(bm: BlockManager, r: Request, n: int, cached=()) -> None:
    """A step computing ``n`` tokens of ``r`` (after ``cached``), scheduled and launched."""
    assert bm.allocate(r, n, cached)
    r.num_computed_tokens += len(cached) * BS + n
    bm.cache_full_blocks(r, r.num_computed_tokens)
    bm.end_step()
    bm.computed([r])


def held(bm: BlockManager) -> int:
    return bm.window.num_blocks - bm.window.num_free_blocks


def test_a_request_keeps_only_the_window_blocks_its_next_queries_read():
    bm = BlockManager(64, BS, window=W, num_window_blocks=8)
    r = req(40)
    run(bm, r, 24)  # positions 0..23 in one chunk: its 6 blocks held while the step runs
    # the next query (24) reads 17 onward: block 4 on, and one block of slack (3)
    assert r.window_from == 3 and held(bm) == 3
    for _ in range(16):  # decodes past 40: never more than the window, the slack and the block being filled
        run(bm, r, 1)
        assert len(r.block_table) - r.window_from <= W // BS + 2
    assert bm.num_used_blocks == 10  # every block still held in the full layers
    bm.free(r)
    assert held(bm) == 0 and bm.window.num_free_blocks == 8
    assert all(s < 0 for s in bm.window.of)  # without prefix caching nothing is kept linked


def test_stats_report_the_fuller_pool():
    """kv_usage, num_free_blocks and num_kv_blocks (/health, and over data-parallel engines free / blocks)
    count the pool that runs out first: for a model whose layers all slide, the window pool."""
    bm = BlockManager(64, BS, window=W, num_window_blocks=8)  # many names, few window blocks
    run(bm, req(12), 12)
    assert bm.fuller_pool == (bm.window.num_free_blocks, 8) and bm.usage == bm.window.usage > 0
    full = BlockManager(4, BS, window=W, num_window_blocks=16)  # the full blocks short
    run(full, req(12), 12)
    assert full.fuller_pool == (1, 4) and full.usage == 0.75


def test_links_reach_the_device_once_and_dropped_ones_never():
    bm = BlockManager(16, BS, window=W, num_window_blocks=8)
    r = req(12)
    assert bm.allocate(r, 12)
    writes = bm.take_window_writes()
    assert writes == [(b, bm.window.of[b]) for b in r.block_table] and bm.take_window_writes() == []


def test_allocation_is_refused_whole_when_the_window_pool_is_short():
    bm = BlockManager(64, BS, window=W, num_window_blocks=5)
    a, b = req(20, "a"), req(12, "b")
    run(bm, a, 16)  # holds blocks 1, 2, 3 (the next query, 16, reads position 9 on: block 2, and the slack)
    assert held(bm) == 3
    assert not bm.allocate(b, 12)  # three window blocks, two left
    assert b.block_table == [] and bm.num_used_blocks == 4 and held(bm) == 3
    assert bm.allocate(b, 8)
    with pytest.raises(ValueError, match="more than 4 blocks"):  # not even one request's window and a step
        BlockManager(64, BS, window=W, num_window_blocks=4)


def test_a_prefix_hit_reaches_only_as_far_as_its_window_blocks_are_kept():
    bm = BlockManager(64, BS, enable_prefix_caching=True, window=W, num_window_blocks=6)
    first = req(24, "first")
    run(bm, first, 24)  # trimmed to blocks 3.. (the next query, 24, reads 17 on); 0..2 kept findable
    bm.free(first)
    follow = req(list(range(24)) + [99] * 4, "follow")  # the conversation's next turn
    assert len(bm.match_prefix(follow, 27)) == 6  # its window blocks (4, 5) were the last let go of
    # a prompt sharing only the first 12 tokens would read blocks 1, 2 there: still kept, so a hit
    other = req(list(range(12)) + [7] * 8, "other")
    assert len(bm.match_prefix(other, 19)) == 3
    # fill the window pool with another request: the kept window blocks are evicted, least recent first
    run(bm, req([5] * 24, "filler"), 24)
    assert len(bm.match_prefix(other, 19)) < 3
    assert len(bm.match_prefix(follow, 27)) < 6


def test_a_prefix_cache_reset_lets_the_kept_window_blocks_go():
    bm = BlockManager(64, BS, enable_prefix_caching=True, window=W, num_window_blocks=6)
    first = req(24, "first")
    run(bm, first, 24)
    bm.free(first)
    assert bm.window.evictable and bm.reset_prefix_cache()
    assert bm.window.num_free_blocks == 6 and not bm.window.evictable and all(s < 0 for s in bm.window.of)
    assert bm.match_prefix(req(list(range(24)) + [99] * 4, "follow"), 27) == []


def test_evicting_a_block_drops_its_window_block_and_a_failed_step_keeps_none():
    bm = BlockManager(6, BS, enable_prefix_caching=True, window=W, num_window_blocks=6)
    a = req(24, "a")
    run(bm, a, 24)
    bm.free(a)
    assert len(bm.window.evictable) > 0
    b = req([3] * 24, "b")
    assert bm.allocate(b, 24)  # every full block evicted for b: their window blocks go with them
    assert all(bm.window.owner[s] in b.block_table for s in range(6) if bm.window.owner[s] >= 0)
    bm.cache_full_blocks(b, 24)
    bm.free(b)  # b leaves the step that was to compute its blocks
    bm.end_step(computed=False)
    assert bm.window.num_free_blocks == 6 and not bm.window.evictable and all(s < 0 for s in bm.window.of)


def test_a_pool_short_of_the_sequences_windows_runs_fewer_at_once_and_finishes_all():
    """A pool smaller than ``pool_needed`` (an all-sliding model short of memory): more requests than it
    holds windows for would push each other out, and one pushed out loses its work (its window blocks go
    before it comes back), so the scheduler runs only as many as it holds. Priority with aging, where a
    waiting request soon outranks a running one, is where it mattered (found by a review's fuzzing)."""
    from engine.scheduler import Scheduler

    bm = BlockManager(256, 2, enable_prefix_caching=True, window=3, num_window_blocks=7)
    now = [0.0]
    s = Scheduler(bm, 8, 16, policy="priority", aging_seconds=1.0, clock=lambda: now[0])
    assert s.max_num_seqs == 1  # (7 blocks - a step's 8) // (a window's 3 + 1): at least one
    reqs = [Request(f"r{i}", [100 * i + j for j in range(40)], SamplingParams(max_tokens=4)) for i in range(10)]
    for r in reqs:
        s.add(r)
        now[0] += 0.3
    for _ in range(1000):
        if not s.has_work():
            break
        now[0] += 1.0
        batch = s.schedule()
        s.update_from_output(batch, 0.01)
        for r in batch.requests:
            if r.num_computed_tokens == r.num_tokens:
                r.append_token(7)
                if len(r.output_token_ids) == 4:
                    s.finish(r, "length")
    assert not s.has_work() and bm.window.num_free_blocks == 7


# ---------------------------------------------------------------------------------------- sizing


def gemma_like(layers: int = 18, window_every: int = 6) -> types.SimpleNamespace:
    """Gemma 3 270M's shape: 18 layers, five of each six with a window of 512."""
    cfg = types.SimpleNamespace(num_layers=layers, num_kv_heads=1, head_dim=256, sliding_window=512, encoder=None)
    cfg.window = lambda i: 512 if (i + 1) % window_every else 0
    return cfg


def test_sizing_gives_the_full_layers_what_the_window_pool_leaves():
    cfg, cuda, bf16 = gemma_like(), torch.device("cuda"), torch.bfloat16  # (only the type is read)
    layer_block = kv_block_bytes(cfg, 16, bf16) // 18
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048, kv_cache_memory=18 * 4000 * layer_block)
    blocks, window_blocks = count_kv_blocks(config, cfg, cuda, bf16, 8192)
    assert window_blocks == 16 * (512 // 16 + 3) + 2048 // 16  # every sequence's window, slack, one step
    assert 15 * window_blocks + 3 * blocks <= 18 * 4000 and blocks > 4000 * 4  # over 4x the tokens
    # many sequences in little memory: the pool would be no smaller, so every layer keeps every block
    many = EngineConfig(max_num_seqs=256, kv_cache_memory=18 * 4000 * layer_block)
    assert count_kv_blocks(many, cfg, cuda, bf16, 8192) == (4000, 0)
    # the user's choice, and a window spanning the whole length: no pool
    off = EngineConfig(max_num_seqs=16, kv_cache_memory=18 * 4000 * layer_block, disable_hybrid_kv_cache_manager=True)
    assert count_kv_blocks(off, cfg, cuda, bf16, 8192) == (4000, 0)
    assert count_kv_blocks(config, cfg, cuda, bf16, 512) == (4000, 0)
    # every layer sliding (Mistral-7B-v0.1): blocks are only names, every sequence at full length
    all_sliding = gemma_like(window_every=10**9)
    assert count_kv_blocks(config, all_sliding, cuda, bf16, 8192) == (16 * 512, window_blocks)


# ---------------------------------------------------------------------------------------- output


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("g3") / "m"), "gemma3_text", smollm_tokenizer_dir, seed=3)


def prompts(n: int = 6) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 3000 + 5 for j in range(40 + 23 * i)] for i in range(n)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def generate(path: str, hybrid: bool, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", num_kv_blocks=config.pop("num_kv_blocks", 256),
              disable_hybrid_kv_cache_manager=not hybrid, **config)
    assert (llm.engine.block_manager.window is not None) == hybrid
    return [o.token_ids for o in llm.generate(prompts(), GREEDY)], llm


@pytest.mark.parametrize("config", [
    {}, {"max_num_batched_tokens": 8}, {"async_scheduling": "on"}, {"enforce_eager": True},
    {"num_kv_blocks": 24, "max_num_batched_tokens": 32},  # preempted and recomputed
], ids=["one-step", "chunks-of-8", "async", "eager", "preempted"])
def test_the_window_pool_never_changes_greedy_output(gemma3, config):
    want, _ = generate(gemma3, False, **dict(config))
    got, llm = generate(gemma3, True, **dict(config))
    assert got == want
    bm = llm.engine.block_manager
    assert bm.window.num_free_blocks == bm.window.num_blocks  # all let go of
    if "num_kv_blocks" in config:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_hits_with_a_window_pool_give_the_same_output(gemma3):
    """A conversation's next turn hits its whole history; the same prompt again hits all but its last token."""
    llm = LLM(gemma3, dtype="float32", num_kv_blocks=256)
    off = LLM(gemma3, dtype="float32", num_kv_blocks=256, disable_hybrid_kv_cache_manager=True)
    first = prompts()[3]
    turn = llm.generate([first], GREEDY)[0]
    follow = first + turn.token_ids + [17, 18, 19, 20, 21]
    got = llm.generate([follow, first], GREEDY)
    assert got[0].num_cached_tokens >= len(follow) - 16 and got[1].num_cached_tokens >= len(first) - 16
    assert [o.token_ids for o in got] == [o.token_ids for o in off.generate([follow, first], GREEDY)]


def test_window_blocks_held_stay_within_the_window_while_generating(gemma3):
    llm = LLM(gemma3, dtype="float32", num_kv_blocks=256)
    eng, window = llm.engine, llm.engine.block_manager.window
    for i, p in enumerate(prompts(4)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
        for r in eng.scheduler.running:  # (window 16, blocks of 16: the window, its slack, the block being filled)
            assert len(r.block_table) - r.window_from <= 3, r
        assert window.num_blocks - window.num_free_blocks <= 3 * len(eng.scheduler.running)
    assert window.num_free_blocks == window.num_blocks


def test_an_all_sliding_model_keeps_only_its_window(tmp_path, smollm_tokenizer_dir):
    """Mistral-7B-v0.1's way: every layer windowed, so no layer keeps a block past the window."""
    path = make_tiny_model(str(tmp_path / "swa"), "mistral", smollm_tokenizer_dir, seed=4)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config | {"sliding_window": 16}, f)
    want, _ = generate(path, False, num_kv_blocks=64)
    got, llm = generate(path, True, num_kv_blocks=64)
    assert got == want
    assert llm.engine.runner.kv_cache.shape[1] == 0  # no full layers: the blocks are only names
    assert llm.engine.block_manager.num_blocks == 64 * llm.engine.max_model_len // 16
    # a pool of 5 blocks: one request's window (3) and a step of two blocks; prompts up to 10 blocks
    got, llm = generate(path, True, num_kv_blocks=5)
    assert got == want and llm.engine.block_manager.max_step_tokens == 32
