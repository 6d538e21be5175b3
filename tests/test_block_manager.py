"""Block manager: exact block ids, free-queue order, ref counts."""

import pytest

from engine.block_manager import BlockManager
from engine.protocol import SamplingParams
from engine.request import Request


def req(n_tokens: int, rid: str = "r") -> Request:
    return Request(rid, list(range(n_tokens)), SamplingParams())


def test_allocate_takes_blocks_from_the_front_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = req(6, "a"), req(4, "b")
    assert bm.blocks_needed(a, 6) == 2
    assert bm.allocate(a, 6)
    assert a.block_table == [0, 1]
    assert bm.allocate(b, 4)
    assert b.block_table == [2]
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]
    assert bm.ref_counts[:4] == [1, 1, 1, 0]


def test_growing_a_request_adds_blocks_only_at_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req(3)
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    assert bm.blocks_needed(a, 1) == 0  # token 4 still fits in block 0
    bm.allocate(a, 1)
    assert a.block_table == [0]
    a.num_computed_tokens = 4
    assert bm.blocks_needed(a, 1) == 1
    bm.allocate(a, 1)
    assert a.block_table == [0, 1]


def test_allocate_fails_without_partial_change():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = req(12)
    assert not bm.can_allocate(a, 12)
    assert not bm.allocate(a, 12)
    assert a.block_table == []
    assert bm.num_free_blocks == 2


def test_free_returns_blocks_tail_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = req(6, "a"), req(2, "b")
    bm.allocate(a, 6)  # [0, 1, 2]
    bm.allocate(b, 2)  # [3]
    bm.free(a)
    # the tail (2) is freed first, so the prefix block (0) is the last to be reused
    assert list(bm.free_block_ids) == [4, 5, 2, 1, 0]
    assert a.block_table == []
    assert bm.usage == pytest.approx(1 / 6)
    bm.free(b)
    assert bm.num_free_blocks == 6
    assert bm.ref_counts == [0] * 6


def test_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
