"""Continuous batching that schedules tokens, not phases.

Each step fills a token budget (``max_num_batched_tokens``) and a sequence
budget (``max_num_seqs``). Every request has ``num_computed_tokens`` catching up
with its token count, so a decode (one token), a prompt chunk (many) and a
resumed preempted request (its prompt and outputs again) are the same thing.
Running requests go first, in admission order; waiting ones fill what is left.
When blocks run out, the most recently admitted running request is preempted
(its blocks freed, recomputed later). Torch-free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per request, this step
    preempted: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: int = 1024):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.num_preemptions = 0  # since start, for stats

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not bm.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1

        # Admit waiting requests only on a step that preempted nothing: blocks are short.
        while (not batch.preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not bm.allocate(req, n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop its KV, put it at the front of the queue."""
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Take ``req`` out (finished or aborted) and free its blocks at once."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
