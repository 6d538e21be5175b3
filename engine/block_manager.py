"""The paged KV cache's bookkeeping: which fixed-size block holds which tokens,
and which computed blocks can be shared (prefix caching).

Torch-free: block ids only; the tensors live in the model runner. A request
owns a ``block_table`` (list of block ids, in token order); a block's ref count
is the number of requests whose table holds it.

Prefix caching: a full, computed block is named by a hash chained over its
token ids (and the hashes of the images whose placeholders it holds) and its parent
block's hash; the chain starts from a root that covers the model and dtype
(``hash_seed``), the request's LoRA adapter (which load of it) and its
``cache_salt``, so tenants with different salts never share a block. A new request takes every
cached block of its longest cached prefix (ref counts up) and computes only the
rest. Hashes are 128-bit BLAKE2b: a client cannot craft a prompt whose blocks
collide with another tenant's. A block is findable as soon as a step is
scheduled to fill it, so requests admitted together (``n`` > 1 samples, a burst
sharing a system prompt) share it from the first step: one forward pass stores
every new token's K/V before any attention reads the cache. The scheduler keeps
the request computing such a *pending* block in its step (``providers``). A block
holding a token that a step in flight samples (asynchronous scheduling) cannot be
named yet: it is offered when the request is next scheduled, its tokens known.

Freed blocks keep their contents and hash: they count as free, and are only
evicted when a block is needed and no block without contents is left, least
recently freed first. A request frees its blocks tail first, so its tail is
evicted before its prefix, which other requests are likelier to share.

A model with sliding-window layers keeps their K/V in a pool of its own
(``engine.window_blocks``): a block is given a window block there while a request
may still read it in those layers. A request is admitted, and grows, only when both
pools have room; a prefix hit counts up to where the window blocks it reads are kept.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from engine.request import Request
from engine.window_blocks import WindowBlocks


def chain_hash(parent: bytes, token_ids: list[int], images: bytes = b"") -> bytes:
    """The name of a block holding ``token_ids`` after the block named ``parent``; ``images``: the hashes of the
    images whose placeholders it holds (their tokens alike, their K/V not)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes() + images, digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 hash_seed: bytes = b"", window: int = 0, num_window_blocks: int = 0):
        """``num_window_blocks``: the sliding-window layers' own pool, for a ``window`` of that many
        positions (0: those layers, if any, keep every block as the others)."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed  # what else changes a block's K/V: the model and dtype
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks  # set while a block is findable
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # free and holding nothing findable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but findable, least recently freed first
        self.pending: dict[int, str] = {}  # findable blocks this step computes -> the request computing them
        self.num_evictions = 0  # since start
        self.window = WindowBlocks(num_window_blocks, num_blocks, window, block_size) if num_window_blocks else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """The fuller pool's share in use."""
        used = self.num_used_blocks / self.num_blocks
        return max(used, self.window.usage) if self.window else used

    @property
    def fuller_pool(self) -> tuple[int, int]:
        """The fuller pool's free blocks and size, as ``usage`` counts them (for a model whose layers all
        slide, the window pool: its full blocks are names only, never short)."""
        if self.window and self.window.usage > self.num_used_blocks / self.num_blocks:
            return self.window.num_free_blocks, self.window.num_blocks
        return self.num_free_blocks, self.num_blocks

    @property
    def max_step_tokens(self) -> int | None:
        """The most tokens one request may compute in one step (None: no bound but the token budget's):
        a step's tokens all need window blocks at once, and the pool must hold them beside its window."""
        return self.window.max_step_tokens if self.window else None

    # ------------------------------------------------------------------ prefix caching

    def match_prefix(self, req: Request, max_tokens: int) -> list[int]:
        """The cached blocks holding the longest prefix of ``req``'s first ``max_tokens`` tokens
        (whole blocks only), for a request that holds no blocks yet."""
        if not self.enable_prefix_caching:
            return []
        blocks, hashes = [], req.block_hashes
        for i in range(max_tokens // self.block_size):  # (hashed as far as it hits: a miss ends it)
            if i == len(hashes) and len(self._hashes(req, i + 1)) == i:  # (extends req.block_hashes by one)
                break
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            blocks.append(block_id)
        while self.window and blocks and not self.window.covers(blocks):
            blocks.pop()
        return blocks

    def cache_full_blocks(self, req: Request, num_tokens: int, pending: bool = True) -> None:
        """Make the full blocks among ``req``'s first ``num_tokens`` tokens findable. Called when a step
        is scheduled to compute them: a request admitted later in the same step may hit them, since a
        forward pass stores every new token's K/V before any attention reads the cache. Until
        ``end_step`` they are *pending*: ``providers`` names who computes them, and ``free`` forgets
        them if that request leaves the step (preempted) without computing them. ``pending`` False: their
        K/V are in the cache already (a step that ran)."""
        if not self.enable_prefix_caching:
            return
        if num_tokens // self.block_size <= req.num_cached_blocks:  # (most calls: no block filled)
            return
        num_full = min(num_tokens, req.num_tokens) // self.block_size  # (not past a token still in flight)
        if num_full <= req.num_cached_blocks:
            return
        hashes = self._hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            block_id, h = req.block_table[i], hashes[i]
            if h not in self.cached:  # else an identical block computed alongside: this one stays private
                self.cached[h] = block_id
                self.block_hash[block_id] = h
                if pending:
                    self.pending[block_id] = req.request_id
        req.num_cached_blocks = num_full

    def providers(self, blocks: Iterable[int]) -> set[str]:
        """The requests computing, in this step, any of ``blocks`` (pending hits): they must stay in it."""
        return {self.pending[b] for b in blocks if b in self.pending}

    def end_step(self, computed: bool = True) -> None:
        """The scheduled step ran: every pending block holds its K/V now. Or it failed (``computed``
        False): none does, so none may be found."""
        if not computed:
            for block_id in list(self.pending):
                self._forget(block_id)
        self.pending.clear()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached block, so that no later request finds one (a benchmark's rounds start cold;
        a reloaded model's K/V would differ), when no request holds a block; else False, nothing forgotten. (Without
        prefix caching there is nothing to forget: True.)"""
        if not self.enable_prefix_caching:
            return True
        if self.num_used_blocks or self.pending:
            return False
        for block_id in self.evictable:  # (with no block in use, every cached block is evictable)
            self._forget(block_id)
        self.free_block_ids.extend(self.evictable)
        self.evictable.clear()
        return True

    def _forget(self, block_id: int) -> None:
        if self.window:
            self.window.drop(block_id)
        del self.cached[self.block_hash[block_id]]
        self.block_hash[block_id] = None
        self.pending.pop(block_id, None)

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Chained hashes of ``req``'s first ``num_blocks`` full blocks, computed once per request."""
        hashes, tokens, bs = req.block_hashes, req.all_token_ids, self.block_size
        if hashes:
            parent = hashes[-1]
        else:  # the root: the model, the request's LoRA adapter (its length first) and its salt
            lora = req.lora.encode()
            parent = chain_hash(self.hash_seed + len(lora).to_bytes(4, "little") + lora + req.cache_salt.encode(), [])
        images = req.images
        for i in range(len(hashes), min(num_blocks, len(tokens) // bs)):
            lo, hi = i * bs, (i + 1) * bs
            seen = b"".join(im.hash for im in images if im.offset < hi and im.end > lo) if images else b""
            parent = chain_hash(parent, tokens[lo:hi], seen)
            hashes.append(parent)
        return hashes if len(hashes) <= num_blocks else hashes[:num_blocks]

    # ------------------------------------------------------------------ allocation

    def blocks_needed(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free blocks it takes for ``req`` to hold its computed tokens, the ``cached`` blocks it is
        given (from ``match_prefix``) and ``num_new_tokens`` more."""
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        new = max(0, -(-total // self.block_size) - len(req.block_table) - len(cached))
        return new + sum(1 for b in cached if self.ref_counts[b] == 0)  # a free cached block leaves the pool

    def can_allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether the blocks to hold that many tokens are free (window blocks are taken a step at a
        time: a step's tokens need theirs, a request's whole context never does)."""
        return self.blocks_needed(req, num_new_tokens, cached) <= self.num_free_blocks

    @property
    def tokens_per_block(self) -> int:
        """The tokens each block of a table holds, for telling whether a request's blocks hold its next
        ones without asking ``allocate``; 0 with a sliding-window pool (whose blocks ``allocate`` trims)."""
        return self.block_size if self.window is None else 0

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow ``req.block_table`` by the ``cached`` blocks, then for ``num_new_tokens`` more tokens
        (the step computing them); False (and no change) if it can't."""
        if not cached and self.window is None:  # (most calls: a running request's next step, a decode)
            short = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(req.block_table)
            if short > 0 and short > self.num_free_blocks:  # (short > 0 one step in block_size)
                return False
            for _ in range(short):
                req.block_table.append(self._take())
            return True
        if self.blocks_needed(req, num_new_tokens, cached) > self.num_free_blocks:
            return False
        start = req.num_computed_tokens + len(cached) * self.block_size  # the step's first position
        first_new, blocks = len(req.block_table), -(-(start + num_new_tokens) // self.block_size)
        if self.window:
            new = max(0, blocks - first_new - len(cached))
            if self.window.needed(req, cached, new, start) > self.window.num_free_blocks:
                return False
        for block_id in cached:
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
            req.block_table.append(block_id)
        if cached:
            req.num_cached_blocks = len(cached)
        for _ in range(blocks - len(req.block_table)):
            req.block_table.append(self._take())
        if self.window:
            self.window.hold(req, first_new, start)
        return True

    def computed(self, reqs: Iterable[Request]) -> None:
        """``reqs`` have computed more tokens (a step ran, or is on its way: any later step runs after it):
        the window blocks their next queries no longer read go."""
        if self.window:
            for req in reqs:
                self.window.trim(req, self.block_hash)

    def take_window_writes(self) -> list[tuple[int, int]]:
        """(block, window block) links made since the last call, for the device's map."""
        return self.window.take_writes() if self.window else []

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first."""
        if self.window:
            self.window.free(req, self.block_hash)
        for block_id in reversed(req.block_table):
            if self.pending.get(block_id) == req.request_id:  # it left the step that was to compute the block
                self._forget(block_id)
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.evictable[block_id] = None
        req.block_table = []
        req.num_cached_blocks = 0

    def _take(self) -> int:
        """A free block: one holding nothing findable if any, else the least recently freed cached one."""
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            if self.window:
                self.window.drop(block_id)
            del self.cached[self.block_hash[block_id]]
            self.block_hash[block_id] = None
            self.num_evictions += 1
        self.ref_counts[block_id] = 1
        return block_id
