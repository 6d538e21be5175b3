"""The paged KV cache's bookkeeping: which fixed-size block holds which tokens.

Torch-free: block ids only; the tensors live in the model runner. A request
owns a ``block_table`` (list of block ids, in token order). Free blocks sit in
a queue taken from the front; a finished request gives its blocks back tail
first, so when prefix caching keeps freed blocks reusable, a shared prefix is
the last thing evicted.
"""

from __future__ import annotations

from collections import deque

from engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks to add so that ``req`` can hold its computed tokens plus ``num_new_tokens``."""
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(req, num_new_tokens) <= self.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow ``req.block_table`` for ``num_new_tokens`` more tokens; False (and no change) if it can't."""
        n = self.blocks_needed(req, num_new_tokens)
        if n > self.num_free_blocks:
            return False
        for _ in range(n):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            req.block_table.append(block_id)
        return True

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first."""
        for block_id in reversed(req.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        req.block_table = []
