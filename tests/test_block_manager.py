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


# ---------------------------------------------------------------------- prefix caching
# Block size 4 throughout: a request's tokens are computed by hand (``compute``) as a step would.


def cached_bm(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, block_size=4, enable_prefix_caching=True, hash_seed=b"tiny|float32")


def tokens_req(tokens: list[int], rid: str, salt: str = "") -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, r: Request) -> int:
    """What the scheduler does: take the cached prefix (all but the last token), allocate the rest,
    compute it all. Returns the number of cached tokens."""
    cached = bm.match_prefix(r, r.num_tokens - 1)
    hit = len(cached) * bm.block_size
    assert bm.allocate(r, r.num_tokens - hit, cached)
    bm.cache_full_blocks(r, r.num_tokens)  # scheduled
    r.num_computed_tokens = r.num_tokens
    bm.end_step()  # computed
    return hit


PROMPT = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] and a partial [108, 109]


def test_a_full_hit_reuses_every_full_block_and_computes_the_rest():
    bm = cached_bm()
    a = tokens_req(PROMPT, "a")
    assert admit(bm, a) == 0
    assert a.block_table == [0, 1, 2]
    b = tokens_req(PROMPT, "b")
    assert admit(bm, b) == 8
    assert b.block_table == [0, 1, 3]  # the partial last block is its own
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 4


def test_the_last_token_is_always_computed():
    bm = cached_bm()
    a = tokens_req(PROMPT[:8], "a")  # exactly two blocks
    admit(bm, a)
    b = tokens_req(PROMPT[:8], "b")
    assert admit(bm, b) == 4  # block 1 holds the last token, whose logits are needed: recomputed
    assert b.block_table == [0, 2]


def test_divergence_mid_block_hits_only_the_whole_blocks_before_it():
    bm = cached_bm()
    admit(bm, tokens_req(PROMPT, "a"))  # [0, 1, 2]
    b = tokens_req(PROMPT[:6] + [7, 7, 7, 7], "b")  # differs from token 6, inside block 1
    assert admit(bm, b) == 4
    assert b.block_table == [0, 3, 4]
    c = tokens_req([1] + PROMPT[1:], "c")  # differs in the first token: the chain breaks at once
    assert admit(bm, c) == 0
    assert c.block_table == [5, 6, 7]


def test_same_tokens_after_a_different_prefix_do_not_hit():
    bm = cached_bm()
    admit(bm, tokens_req([1, 2, 3, 4] + PROMPT[4:], "a"))
    b = tokens_req([5, 6, 7, 8] + PROMPT[4:], "b")  # block 1 has the same tokens, another parent
    assert admit(bm, b) == 0


def test_salts_isolate_tenants():
    bm = cached_bm(12)
    admit(bm, tokens_req(PROMPT, "a", salt="tenant-1"))
    assert admit(bm, tokens_req(PROMPT, "b", salt="tenant-2")) == 0
    assert admit(bm, tokens_req(PROMPT, "c")) == 0
    assert admit(bm, tokens_req(PROMPT, "d", salt="tenant-1")) == 8


def test_freed_blocks_stay_cached_count_as_free_and_are_hit_again():
    bm = cached_bm()
    a = tokens_req(PROMPT, "a")
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    # the partial block holds nothing findable: plainly free; the full ones wait, tail first
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 2]
    assert list(bm.evictable) == [1, 0]
    b = tokens_req(PROMPT, "b")
    assert admit(bm, b) == 8
    assert b.block_table == [0, 1, 3]
    assert list(bm.evictable) == []
    assert bm.ref_counts[:2] == [1, 1]


def test_a_reset_forgets_every_cached_block_but_never_one_a_request_holds():
    """vLLM's reset_prefix_cache: refused (False, nothing forgotten) while a request holds blocks; then every
    cached block is plainly free and no prompt finds one."""
    bm = cached_bm()
    a, b = tokens_req(PROMPT, "a"), tokens_req(PROMPT[:4] + [1, 2, 3, 4], "b")
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    assert not bm.reset_prefix_cache()
    assert len(bm.cached) == 3 and len(bm.match_prefix(tokens_req(PROMPT, "c"), 9)) == 2
    bm.free(b)
    assert bm.reset_prefix_cache()
    assert not bm.cached and not bm.evictable and bm.block_hash == [None] * 8
    assert sorted(bm.free_block_ids) == list(range(8)) and bm.num_free_blocks == 8
    assert admit(bm, tokens_req(PROMPT, "d")) == 0
    assert admit(bm, tokens_req(PROMPT, "e")) == 8  # cached again as new prompts are computed


def test_without_prefix_caching_a_reset_has_nothing_to_forget():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate(req(6), 6) and bm.reset_prefix_cache()


def test_eviction_takes_plain_free_blocks_first_then_least_recently_freed_tail_first():
    bm = cached_bm(6)
    a = tokens_req(PROMPT, "a")
    admit(bm, a)  # [0, 1, 2]
    b = tokens_req(list(range(200, 206)), "b")
    admit(bm, b)  # [3, 4]: one full block, one partial
    bm.free(a)  # evictable: 1, 0; plain: 5, 2
    bm.free(b)  # evictable: 1, 0, 3; plain: 5, 2, 4
    assert list(bm.evictable) == [1, 0, 3]
    c = tokens_req(list(range(300, 316)), "c")  # 4 blocks: the 3 plain ones, then evicts block 1
    cached = bm.match_prefix(c, 15)
    assert cached == []
    assert bm.allocate(c, 16)
    assert c.block_table == [5, 2, 4, 1]
    assert bm.num_evictions == 1
    assert list(bm.evictable) == [0, 3]
    # a's chain lost its second block: a repeat of a hits only the first
    a2 = tokens_req(PROMPT, "a2")
    assert bm.match_prefix(a2, 9) == [0]


def test_a_hit_on_a_free_cached_block_counts_it_as_taken():
    bm = cached_bm(3)
    a = tokens_req(PROMPT, "a")
    admit(bm, a)
    bm.free(a)  # evictable: 1, 0; plain: 2
    b = tokens_req(PROMPT, "b")
    cached = bm.match_prefix(b, 9)
    assert cached == [0, 1]
    assert bm.blocks_needed(b, 2, cached) == 3  # the two cached blocks leave the free pool, plus one new
    assert bm.can_allocate(b, 2, cached)
    assert not bm.can_allocate(b, 6, cached)  # two new blocks would have to evict its own prefix


def test_identical_blocks_computed_side_by_side_stay_private():
    bm = cached_bm()
    a, b = tokens_req(PROMPT, "a"), tokens_req(PROMPT, "b")
    for r in (a, b):  # both admitted before either is computed: no hit
        assert bm.match_prefix(r, 9) == []
        bm.allocate(r, 10)
    for r in (a, b):
        bm.cache_full_blocks(r, 10)
    bm.end_step()
    assert bm.cached == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    bm.free(b)
    assert list(bm.free_block_ids)[-3:] == [5, 4, 3]  # b's blocks are plain free
    assert bm.ref_counts[:3] == [1, 1, 1]


def test_blocks_a_step_will_compute_are_hit_in_that_step_and_forgotten_if_it_leaves():
    bm = cached_bm()
    a = tokens_req(PROMPT, "a")
    assert bm.allocate(a, 10)
    bm.cache_full_blocks(a, 10)  # scheduled: a forward pass stores K/V before attention reads any
    b = tokens_req(PROMPT, "b")
    cached = bm.match_prefix(b, 9)
    assert cached == [0, 1]
    assert bm.providers(cached) == {"a"}  # a must stay in the step: b reads what it computes
    c = tokens_req(PROMPT[:5], "c")
    bm.allocate(c, 5)
    bm.cache_full_blocks(c, 5)  # block 3 holds the same tokens as block 0: stays private
    bm.free(a)  # preempted in the step before anyone took its blocks: they were never computed
    assert bm.cached == {} and bm.block_hash[:2] == [None, None]
    assert bm.match_prefix(b, 9) == []
    assert list(bm.evictable) == []
    d = tokens_req(PROMPT, "d")
    bm.allocate(d, 10)
    bm.cache_full_blocks(d, 10)
    bm.end_step()  # computed: no longer pending
    assert bm.providers(bm.match_prefix(b, 9)) == set()


def test_outputs_fill_blocks_that_are_cached_too():
    bm = cached_bm()
    a = tokens_req(PROMPT[:7], "a")
    admit(bm, a)  # [0, 1], 7 tokens
    a.append_token(107)
    assert bm.allocate(a, 1)
    bm.cache_full_blocks(a, 8)  # block 1 is full now: a later turn of the chat hits it
    a.num_computed_tokens = 8
    bm.end_step()
    assert admit(bm, tokens_req(PROMPT, "b")) == 8


def test_disabled_caching_shares_nothing():
    bm = BlockManager(8, 4)
    a = tokens_req(PROMPT, "a")
    admit(bm, a)
    bm.free(a)
    assert list(bm.evictable) == [] and bm.cached == {}
    assert admit(bm, tokens_req(PROMPT, "b")) == 0
