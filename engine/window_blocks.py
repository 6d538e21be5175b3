"""The sliding-window layers' own KV blocks (a hybrid cache, as vLLM's hybrid KV cache manager and
llama.cpp's SWA cache have it).

A model whose layers mix full attention with a sliding window (Gemma 2 and 3: five of each six
layers see only their last 512 or 1024 positions) needs every block of a sequence in its full
layers, but in its sliding layers only the blocks its next queries can still see. Those layers
keep their K/V in a pool of their own, far smaller: each full block (``BlockManager``'s id, its
token span) has a *window block* in that pool while some request may still read it there, and
none once every request holding it has moved past it. The model looks a block's window block up
on the device (``window_map``: full block id -> window block id), so block tables, prefix
hashes and the scheduler keep speaking of full blocks alone.

A request holds window blocks for its blocks from ``req.window_from`` on: from the first block its
next queries read (a query at position p sees p - window + 1 onward), less one block of slack, so
that a later request hitting the prefix cache where this one ended (a conversation's next turn)
finds the window it needs. After each step (``trim``) it lets go of those it has moved past. A
window block let go of keeps its contents while its full block stays findable in the prefix cache
(evicted least recently freed first); a prefix hit counts only up to where the window blocks it
would read are all still there (``covers``).

Torch-free, as the block manager.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from engine.request import Request


def window_span(window: int, block_size: int) -> int:
    """Window blocks a request holds between steps, at most: its window, the slack, a partial block."""
    return -(-window // block_size) + 2


def pool_needed(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Window blocks that every sequence at once never outgrows: each holding its window (``window_span``)
    and starting a block in a step, and one step's tokens more."""
    return max_num_seqs * (window_span(window, block_size) + 1) + -(-max_num_batched_tokens // block_size)


class WindowBlocks:
    def __init__(self, num_blocks: int, num_full_blocks: int, window: int, block_size: int):
        if num_blocks <= window_span(window, block_size):
            raise ValueError(f"the sliding-window KV cache needs more than {window_span(window, block_size)} "
                             "blocks: one request's window and a step")
        self.num_blocks, self.window, self.block_size = num_blocks, window, block_size
        self.of = [-1] * num_full_blocks  # full block -> its window block (-1: none)
        self.owner = [-1] * num_blocks  # window block -> the full block whose K/V it holds (-1: none)
        self.refs = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # no refs, its full block findable
        self.writes: dict[int, int] = {}  # full block -> window block, linked since the last ``take_writes``

    @property
    def max_step_tokens(self) -> int:
        """Tokens a request alone may compute in a step: what the pool holds beside its window (the
        block its step starts within among them)."""
        return (self.num_blocks - window_span(self.window, self.block_size)) * self.block_size

    def max_seqs(self, max_num_batched_tokens: int) -> int:
        """Requests that may run at once: each holding its window and starting a block in a step, beside a
        step's tokens (``pool_needed`` turned round). More would take each other's window blocks, and a
        request pushed out loses its work: its window blocks go before anyone can hit them."""
        step = -(-max_num_batched_tokens // self.block_size)
        return max(1, (self.num_blocks - step) // (window_span(self.window, self.block_size) + 1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1 - self.num_free_blocks / self.num_blocks

    def first_read(self, position: int) -> int:
        """The first block a query at ``position`` reads."""
        return max(0, (position - self.window + 1) // self.block_size)

    def covers(self, blocks: Sequence[int]) -> bool:
        """Whether the window blocks a request hitting ``blocks`` (a cached prefix) would read are there."""
        return all(self.of[b] >= 0 for b in blocks[self.first_read(len(blocks) * self.block_size):])

    def needed(self, req: Request, cached: Sequence[int], num_new_blocks: int, position: int) -> int:
        """Window blocks the pool gives up for ``req``, whose step starts at ``position``, to hold those of
        the ``cached`` blocks it is given (a request holding none) and of ``num_new_blocks`` new ones."""
        if req.block_table:
            return num_new_blocks
        return num_new_blocks + sum(1 for b in cached[self.first_read(position):]
                                    if self.of[b] < 0 or self.refs[self.of[b]] == 0)

    def hold(self, req: Request, first_new: int, position: int) -> None:
        """``req``'s table grew from block ``first_new`` (0: it held none), its step starting at
        ``position``: take the window blocks of its new blocks."""
        if first_new == 0:
            req.window_from = first_new = self.first_read(position)
        for b in req.block_table[first_new:]:
            s = self.of[b]
            if s < 0:
                s = self._take()
                self.of[b], self.owner[s] = s, b
                self.writes[b] = s
            elif self.refs[s] == 0:
                del self.evictable[s]
            self.refs[s] += 1

    def trim(self, req: Request, findable: Sequence[bytes | None]) -> None:
        """``req`` has computed more: let go of the window blocks its next queries no longer read (keeping
        one block of slack). ``findable``: each full block's prefix hash, or None."""
        end = min(max(0, self.first_read(req.num_computed_tokens) - 1), len(req.block_table))
        for b in req.block_table[req.window_from:end]:
            self._release(b, findable[b] is not None)
        req.window_from = max(req.window_from, end)

    def free(self, req: Request, findable: Sequence[bytes | None]) -> None:
        """Let go of all of ``req``'s window blocks, the earliest first (evicted first)."""
        for b in req.block_table[req.window_from:]:
            self._release(b, findable[b] is not None)
        req.window_from = 0

    def drop(self, full_block: int) -> None:
        """``full_block``'s K/V are gone (evicted, or never computed): so are its window block's, if no
        request holds it."""
        s = self.of[full_block]
        if s >= 0 and self.refs[s] == 0:
            self.evictable.pop(s, None)
            self._unlink(s)
            self.free_ids.append(s)

    def take_writes(self) -> list[tuple[int, int]]:
        """The links made since the last call, (full block, window block): the device's map gets them."""
        writes, self.writes = list(self.writes.items()), {}
        return writes

    def _release(self, full_block: int, findable: bool) -> None:
        s = self.of[full_block]
        self.refs[s] -= 1
        if self.refs[s] == 0:
            if findable:
                self.evictable[s] = None
            else:
                self._unlink(s)
                self.free_ids.append(s)

    def _take(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        s, _ = self.evictable.popitem(last=False)
        self._unlink(s)
        return s

    def _unlink(self, s: int) -> None:
        b = self.owner[s]
        self.of[b], self.owner[s] = -1, -1
        self.writes.pop(b, None)  # (a link never sent: nothing on the device to correct)
