"""Continuous batching that schedules tokens, not phases.

Each step fills a token budget (``max_num_batched_tokens``) and a sequence
budget (``max_num_seqs``). Every request has ``num_computed_tokens`` catching up
with its token count, so a decode (one token), a prompt chunk (many) and a
resumed preempted request (its prompt and outputs again) are the same thing.

One step, in order:

1. Requests past their deadline finish with ``"timeout"``.
2. Decodes of running requests, in admission order: streams never wait for prompts.
3. Prompt tokens (new requests, chunks of long prompts, resumed requests), best
   rank first (``engine.request_queue``: the policy is the waiting queue's
   order), up to the token budget. In a step that carries decodes each request's
   chunk is capped by ``engine.prefill_cap``, so that one prompt adds to the step
   about what a decode-only step of the generations running and waiting costs
   (embedding requests never decode: they do not count): a long prompt never
   stalls the streams, and a queue of prompts still joins as fast as seats free
   up, each bringing its own share (vLLM's ``--long-prefill-token-threshold`` is
   per request too). One prompt longer than the cap at a time takes a chunk
   (vLLM's ``--max-long-partial-prefills 1``), so that several long prompts do
   not stall the streams several times over; the others wait, and shorter ones
   join, from behind a waiting long one too (up to ``LOOK_BEHIND`` of them).
   A cap on the step's prompt tokens in all starved the batch: a prompt-heavy
   load joined at the rate of one decode step's worth of tokens a step, slower
   than requests finished. A step without decodes (an idle server)
   gives each request the whole token budget. With ``delay_factor`` (vLLM's
   ``--scheduler-delay-factor``) waiting requests join a step that carries
   decodes only once the oldest has waited that many times as long as the last
   step with prompt tokens took: fewer, larger such steps (on CUDA each costs
   several decode-only steps). A request
   being admitted starts after the longest prefix the block manager has cached
   (all but its last token at most; a block counts from the step that fills it),
   and computes only the rest. A request whose blocks another hit in this step
   is not preempted in it.

A prompt chunk that reaches an image (``engine.models.vision``) not yet encoded also counts the image's
positions against the step's prompt tokens, the vision tower's work being of that order: a burst of image
requests encodes a step's worth of images, not all of them at once; the chunk stops before an image that does
not fit (the step's first prompt chunk takes one whatever its size).

Preemption is by recompute: the victim's blocks are freed (its full blocks stay
in the prefix cache until evicted, so it resumes cheaply) and it waits again
(keeping its arrival time, so its rank). When a running request needs a block
and none is free, the worst-ranked running request goes (the most recently
admitted among equals; under fcfs the latest arrival), possibly the one asking.
Under the ``priority`` policy a waiting request that ranks half a level better
than a running one also preempts it when the sequence budget or the blocks are short;
under ``fair``, one whose client holds two seats fewer than another preempts the
request of the client holding the most that is cheapest to compute again (if it
costs no more than the waiting one's work). No
thrash: a preempted request is not chosen again until it has produced another
token, unless nothing else is left. Nothing is admitted after a step has had to
preempt for blocks.

``one_at_a_time`` (set by the engine while it recovers from a step that ran out
of memory) admits at most one waiting request per step, and only when every
running request is decoding, preempting for it or not: a step then computes at
most one prompt, so if it fails, that prompt is the culprit; and it takes no
speculative drafts, so a request that failed in a step with some is retried without.

Speculative decoding (``engine.speculative``): once the decodes and the prompts have their tokens,
each decode gets the drafts the proposer finds for it, in admission order, as far as the token budget
goes and only where its blocks are free (a guess never delays a prompt nor preempts anyone); they are
the batch's ``num_drafts``, counted neither as decodes nor as prompt tokens (the prefill cap learns
their cost as decode rows'). None while more requests run than ``disable_by_batch_size``. After the
step ``update_from_output`` is told how many of each request's drafts were rejected: those positions
do not count as computed, and later steps write over them; the scheduler counts drafts and those kept.
Blocks hashed for the prefix cache never hold a draft: a block is named from the request's tokens,
and drafts are not among them until kept.

Asynchronous scheduling (``Engine``) schedules step N+1 while step N runs: a request that
samples in N has that token in flight (``Request.num_in_flight``) and is scheduled for one more
decode token, its input being the token in flight (the runner takes it from N's output on the
device), unless that token is its last by ``max_tokens``. A request preempted with a token in
flight is not readmitted before that token is known (the step after).
Torch-free.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.prefill_cap import PrefillCap
from engine.request import Request, Status
from engine.request_queue import expected_work, make_queue
from engine.speculative import NgramProposer

log = logging.getLogger("tokenmill.engine")

# Long waiting prompts a step passes over, at most, for shorter ones behind them: a queue of a thousand long
# prompts cost 2.2 ms a step when each step walked it whole (fcfs; 4.4 ms under priority, its heap's pops)
LOOK_BEHIND = 16


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per request, this step
    preempted: list[Request] = field(default_factory=list)
    timed_out: list[Request] = field(default_factory=list)  # finished by their deadline this step
    num_tokens: int = 0  # sum of num_new_tokens
    num_drafts: int = 0  # of which speculative drafts (engine.speculative), after their decodes' tokens
    image_tokens: int = 0  # positions of the images the step's prompt chunks begin (the vision tower's work)
    short_of_blocks: bool = False  # a running request had to preempt for blocks: admit nobody
    pinned: set[str] = field(default_factory=set)  # compute blocks that others hit this step: never preempted
    window_writes: list[tuple[int, int]] = field(default_factory=list)  # (block, window block) links made
    num_decodes: int = 0  # the first requests: those computing the one token they sample from
    _members: set[Request] = field(default_factory=set)  # (the requests themselves: hashed by identity)

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, req: Request) -> bool:
        return req in self._members

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens - self.num_decodes - self.num_drafts

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self._members.add(req)
        self.num_tokens += n

    def add_decodes(self, reqs: list[Request]) -> None:
        """One token each (their drafts come with ``add_drafts``), added before any prompt's: in one go, for
        a step's hundreds of decodes."""
        self.requests += reqs
        self.num_new_tokens += [1] * len(reqs)
        self._members.update(reqs)
        self.num_tokens += len(reqs)
        self.num_decodes += len(reqs)

    def add_drafts(self, i: int, n: int) -> None:
        """The ``i``-th request, a decode, computes ``n`` drafts after its token."""
        self.num_new_tokens[i] += n
        self.num_tokens += n
        self.num_drafts += n

    def remove(self, req: Request) -> None:
        """Take ``req`` back out (it was preempted after being scheduled)."""
        i = self.requests.index(req)
        del self.requests[i]
        self._members.discard(req)
        n = self.num_new_tokens.pop(i)
        self.num_tokens -= n
        if i < self.num_decodes:
            self.num_decodes -= 1
            self.num_drafts -= n - 1


class QueueFull(Exception):
    pass


class PromptTooLong(ValueError):
    pass


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_num_waiting_requests: int = 1024, policy: str = "fcfs", aging_seconds: float = 30.0,
                 prefill_cap: PrefillCap | None = None, clock: Callable[[], float] = time.time,
                 proposer: NgramProposer | None = None, delay_factor: float = 0.0):
        self.block_manager = block_manager
        window = block_manager.window
        held = window.max_seqs(max_num_batched_tokens) if window is not None else max_num_seqs
        if held < max_num_seqs:  # a window pool short of the sequences' windows
            max_num_seqs = held
            log.warning("at most %d sequences at once: the sliding-window layers' KV pool holds no more windows "
                        "(give the KV cache more memory, or lower --max-num-batched-tokens)", max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_waiting_requests = max_num_waiting_requests
        self.one_at_a_time = False  # admit one request only when every running request is decoding
        self.waiting = make_queue(policy, aging_seconds)
        self.running: list[Request] = []  # admission order: the last is preempted first among equals
        self.prefill_cap = prefill_cap or PrefillCap(max_num_batched_tokens)
        self.proposer = proposer  # speculative decoding's drafts (engine.speculative), if on
        self.delay_factor = delay_factor  # beside decodes, hold waiting prompts this many prompt steps' times
        self._prompt_seconds: deque[float] = deque(maxlen=5)  # how long the last steps with prompt tokens took
        self._prompt_steps = 0  # steps with prompt tokens so far (the first, paying one-time costs, is not timed)
        self.clock = clock  # unix seconds, as deadlines are
        # heap of (deadline, seq, request): weak references, so that a finished request (its grammar, images,
        # token lists) is freed at once, not when its entry comes up
        self._deadlines: list[tuple[float, int, weakref.ref]] = []
        # heap of (queued_at, seq, request) as each was queued: the oldest waiting one (_delayed) without a walk
        # of the queue; those no longer waiting, or queued again since, linger until they come up (weakly held)
        self._queued: list[tuple[float, int, weakref.ref]] = []
        self._seq = itertools.count()
        self.now = clock()  # this step's time
        self.num_preemptions = 0  # since start, for stats
        self.num_timeouts = 0
        self.num_prompt_tokens = 0  # of admitted requests, since start: the prefix cache's hit rate
        self.num_cached_prompt_tokens = 0
        # speculative decoding since start: decodes that had drafts, their drafts, those kept
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self._waiting_embeddings = 0  # waiting requests that will never decode (engine.pooling)

    def add(self, req: Request, bounded: bool = True) -> None:
        """Queue ``req``; ``bounded``: refused with ``QueueFull`` when the waiting queue is full (False: a later
        part of work already admitted, which must not fail halfway)."""
        if bounded and len(self.waiting) >= self.max_num_waiting_requests:
            raise QueueFull(f"the waiting queue is full ({self.max_num_waiting_requests} requests)")
        bm = self.block_manager
        if bm.blocks_needed(req, _context_needed(req)) > bm.num_blocks:  # could never run, not even alone
            raise PromptTooLong(f"the prompt needs more than the {bm.num_blocks * bm.block_size} tokens "
                                "the KV cache holds")
        req.status = Status.WAITING
        req.arrival_time = req.queued_at = self.clock()
        self.waiting.push(req)
        self._queue_time(req)
        self._waiting_embeddings += req.pool is not None
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, next(self._seq), weakref.ref(req)))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.now = self.waiting.now = self.clock()
        self._expire(batch)
        others = self._schedule_decodes(batch)
        prefilling = sorted((r for r in others if r.status is Status.RUNNING
                             and r.num_tokens - r.num_computed_tokens > (r.pool is None)), key=self.waiting.rank)
        # no prompt token joins a full server's step: its waiting queue, however long, costs nothing
        if prefilling or self.waiting and self._seat_for(self.waiting.peek(), batch):
            budget = cap = self.max_num_batched_tokens - batch.num_tokens
            # the batch being filled: every running and waiting generation, as far as seqs allow (when prompt
            # tokens could join at all: fitting the cap is most of a one-stream step's scheduling). Embeddings
            # never decode: counted, they would size the cap for a batch that never comes, and stall the streams
            if batch.num_decodes and (self.waiting or batch.num_decodes < len(self.running)):
                waiting = len(self.waiting) - self._waiting_embeddings
                joining = min(1, waiting) if self.one_at_a_time else waiting
                generating = sum(r.pool is None for r in self.running)
                rows = min(self.max_num_seqs, generating + joining)
                cap = min(budget, self.prefill_cap.value(rows))
            self._schedule_prompts(batch, prefilling, budget, cap, hold=batch.num_decodes > 0)
        if self.proposer is not None:
            self._add_drafts(batch)
        batch.window_writes = self.block_manager.take_window_writes()
        return batch

    def update_from_output(self, batch: ScheduledBatch, seconds: float, rejected: dict[str, int] | None = None) -> None:
        """After the model ran ``batch`` in ``seconds``: the scheduled tokens are in the cache, but for the
        ``rejected`` drafts (request id -> how many of its last)."""
        self.launched(batch, rejected)
        self.observe(batch, seconds)

    def launched(self, batch: ScheduledBatch, rejected: dict[str, int] | None = None) -> None:
        """``batch`` runs (or is on its way: any later step runs after it): its tokens count as computed
        (its ``rejected`` drafts do not: later steps write over them) and the blocks it fills are no
        longer pending."""
        if rejected:
            for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
                req.num_computed_tokens += n - rejected.get(req.request_id, 0)
        else:
            for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
                req.num_computed_tokens += n
        if batch.num_drafts and rejected is not None:
            kept = batch.num_drafts - sum(rejected.values())
            self.num_drafts += len(rejected)
            self.num_draft_tokens += batch.num_drafts
            self.num_accepted_tokens += kept
        self.block_manager.end_step()
        self.block_manager.computed(batch.requests)
        self.waiting.served(batch.requests, batch.num_new_tokens, batch.num_decodes, rejected)

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """``batch`` took ``seconds``: what the prefill cap learns from."""
        # (a draft is a decode row: a one-token sequence on its request's blocks)
        self.prefill_cap.observe(batch.num_decodes + batch.num_drafts, batch.num_prompt_tokens, seconds)
        if batch.num_prompt_tokens and 0 <= seconds < math.inf:
            self._prompt_steps += 1
            if self._prompt_steps > 1:
                self._prompt_seconds.append(seconds)

    def _delayed(self) -> bool:
        """Waiting prompts are held this step (``delay_factor``): the oldest has waited less than the factor
        times a step with prompt tokens takes (vLLM: the last one; here the lower median of the last five,
        the first ever left out, so that a slow step, a kernel built on first use, holds nobody for long). A
        wait the clock made negative (set back) holds nobody either."""
        if not self.delay_factor or not self.waiting or not self._prompt_seconds:
            return False
        queued = self._queued
        while not self._waits_since(*queued[0]):
            heapq.heappop(queued)  # (admitted, finished, or queued again since)
        waited = self.now - queued[0][0]
        return 0 <= waited < self.delay_factor * statistics.median_low(self._prompt_seconds)

    def _queue_time(self, req: Request) -> None:
        """``req`` was queued at ``req.queued_at``: for ``_delayed``."""
        heapq.heappush(self._queued, (req.queued_at, next(self._seq), weakref.ref(req)))
        if len(self._queued) > 64 and len(self._queued) > 4 * len(self.waiting):  # (drop the stale ones)
            self._queued = [e for e in self._queued if self._waits_since(*e)]
            heapq.heapify(self._queued)

    @staticmethod
    def _waits_since(queued_at: float, _seq: int, ref: weakref.ref) -> bool:
        """Whether a ``_queued`` entry's request is alive and still waiting since it was queued then."""
        req = ref()
        return req is not None and req.status is Status.WAITING and req.queued_at == queued_at

    def rollback(self, batch: ScheduledBatch) -> None:
        """The model failed to run ``batch``: nothing it scheduled was computed. Its requests go back to
        waiting (recomputed if they run again), and no block it was to fill may be found."""
        for req in list(batch.requests):
            if req.status is Status.RUNNING:
                self._preempt(req, batch)
        self.block_manager.end_step(computed=False)

    def finish(self, req: Request, reason: str, cache_computed: bool = False) -> None:
        """Take ``req`` out (finished, aborted or timed out) and free its blocks at once. ``cache_computed``:
        its last step ran (synchronously) and kept drafts, whose blocks are offered to the prefix cache
        first (a decode's are when it is scheduled; these were drafts then)."""
        if cache_computed:
            self.block_manager.cache_full_blocks(req, req.num_computed_tokens, pending=False)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
            self._waiting_embeddings -= req.pool is not None
        self.block_manager.free(req)
        self.waiting.finished(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens admitted, since start."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def kv_fragmentation(self) -> float:
        """Allocated KV slots holding no token, over all allocated slots (only a request's last block has
        empty slots: shared blocks are full)."""
        bs = self.block_manager.block_size
        allocated = self.block_manager.num_used_blocks * bs
        empty = sum(len(r.block_table) * bs - r.num_computed_tokens for r in self.running)
        return empty / allocated if allocated else 0.0

    # ------------------------------------------------------------------ internals

    def _expire(self, batch: ScheduledBatch) -> None:
        while self._deadlines and self._deadlines[0][0] <= self.now:
            req = heapq.heappop(self._deadlines)[2]()
            if req is not None and req.status is not Status.FINISHED:
                self.finish(req, "timeout")
                self.num_timeouts += 1
                batch.timed_out.append(req)
        if len(self._deadlines) > 64 and len(self._deadlines) > 4 * (len(self.waiting) + len(self.running)):
            self._deadlines = [d for d in self._deadlines
                               if (r := d[2]()) is not None and r.status is not Status.FINISHED]
            heapq.heapify(self._deadlines)

    def _schedule_decodes(self, batch: ScheduledBatch) -> list[Request]:
        """Decodes first, in admission order: each running request that computes the one token it samples
        from, but an embedding (its last prompt token is a prompt token) and one whose token in flight is
        its last by ``max_tokens``. (Most of a step's requests: a few operations each.) Returns the running
        requests it did not schedule, those still prefilling among them, in admission order."""
        bm, running, limit = self.block_manager, Status.RUNNING, self.max_num_batched_tokens
        room = limit - batch.num_tokens  # (decodes past it wait)
        per_block = bm.tokens_per_block  # (a decode whose blocks hold its tokens allocates nothing: most)
        # those whose token fills a block for the prefix cache (one step in block_size)
        caching, filling = bm.block_size if bm.enable_prefix_caching else 0, []
        decodes: list[Request] = []  # (added to the batch together: before any allocation, which may preempt)
        others: list[Request] = []
        admitted = list(self.running)  # (a copy: one may be preempted for another's block)
        for req in admitted:
            tokens = len(req.all_token_ids) + req.num_in_flight
            if (tokens - req.num_computed_tokens != 1 or req.pool is not None or req.status is not running
                    or tokens - req.num_prompt_tokens >= req.params.max_tokens):
                others.append(req)
                continue
            if len(decodes) >= room:  # (the budget is spent: no prompt token joins either)
                others += admitted[admitted.index(req):]
                break
            if tokens > len(req.block_table) * per_block:
                batch.add_decodes(decodes)
                decodes = []
                allocated = self._allocate_running(req, 1, batch)
                room = limit - batch.num_tokens  # (less, or more if it preempted one of them)
                if not allocated:
                    continue
            decodes.append(req)
            if caching and tokens // caching > req.num_cached_blocks:
                filling.append(req)
        batch.add_decodes(decodes)
        for req in filling:
            if req.status is running:  # (not one preempted since, for another's block)
                bm.cache_full_blocks(req, req.num_computed_tokens + 1)
        return others

    def _schedule_prompts(self, batch: ScheduledBatch, prefilling: list[Request], limit: int, cap: int,
                          hold: bool = False) -> None:
        """Up to ``limit`` prompt tokens, at most ``cap`` to each request, to running requests still
        ``prefilling`` (best rank first) and to waiting ones, best rank first (unless ``hold`` and the
        scheduler delay holds them)."""
        rank, margin = self.waiting.rank, self.waiting.preempt_margin
        admit = not (self.one_at_a_time and prefilling)
        step_cap = self.block_manager.max_step_tokens or limit  # (a sliding-window pool's bound)
        # beside decodes, one prompt longer than the cap at a time takes a chunk; the others wait, and a long
        # waiting one steps aside (``passed``) for the shorter ones behind it (behind ``LOOK_BEHIND`` at most)
        one_long, long_taken, passed = cap < limit, False, 0
        i = 0
        while batch.num_prompt_tokens + batch.image_tokens < limit:
            head = self.waiting.peek() if admit and self.waiting and not batch.short_of_blocks else None
            if head is not None and head.num_in_flight:  # preempted with a token in flight: back once it is known
                head, admit = None, False
            # a running prompt goes on first unless the head ranks better by the margin a preemption needs (one
            # that may not push it out may not take its chunk either: a burst of long prompts, each ranking a
            # little better than the last admitted as they wait, would start one a step and finish none)
            if i < len(prefilling) and (head is None or rank(prefilling[i]) <= rank(head) + margin):
                req = prefilling[i]
                i += 1
                left = min(req.num_tokens - req.num_computed_tokens, step_cap)
                long = one_long and left > cap
                if long and long_taken:
                    continue
                n, images = _fit_images(req, req.num_computed_tokens, left, limit, cap, batch)
                # (one preempted since this list was made may be running again, readmitted this step)
                if n and req.status is Status.RUNNING and req not in batch and self._allocate_running(req, n, batch):
                    self._add(batch, req, n)
                    batch.image_tokens += images
                    long_taken |= long
                continue
            if head is None:
                break
            if not self._seat_for(head, batch):
                admit = False  # the head waits (and those behind it)
                continue
            if hold:  # (asked once a head could join: a full server's steps never walk the queue for it)
                hold = False
                if self._delayed():
                    admit = False
                    continue
            bm = self.block_manager
            cacheable = _cacheable_tokens(head)
            cached = bm.match_prefix(head, cacheable)
            hit = len(cached) * bm.block_size
            left = min(head.num_tokens - hit, step_cap)
            long = one_long and left > cap
            n, images = _fit_images(head, hit, left, limit, cap, batch)
            # its image waits for a step with room for it; an encoder's prompt for one with room for all of it
            if not n or head.pool is not None and head.pool.whole and n < head.num_tokens:
                admit = False
                continue
            if long and long_taken:  # another long prompt has this step's chunk
                if passed == LOOK_BEHIND:  # (a queue of long prompts: not walked whole every step)
                    admit = False
                    continue
                self.waiting.set_aside()
                passed += 1
                continue
            # a resumed request comes back only when its whole context fits: back in part, it would
            # just be pushed out again
            fits = not head.num_preemptions or bm.can_allocate(head, _context_needed(head) - hit, cached)
            if len(self.running) < self.max_num_seqs and fits and bm.allocate(head, n, cached):
                self.waiting.pop()
                self._waiting_embeddings -= head.pool is not None
                head.num_computed_tokens = hit
                if not head.num_preemptions:  # first admission: what the client is told, and the hit rate
                    head.num_cached_tokens = hit
                    self.num_prompt_tokens += head.num_prompt_tokens
                    self.num_cached_prompt_tokens += hit
                head.waited += self.now - head.queued_at
                head.status = Status.RUNNING
                self.running.append(head)
                batch.pinned |= bm.providers(cached)
                self._add(batch, head, n)
                batch.image_tokens += images
                admit = not self.one_at_a_time
                long_taken |= long
                continue
            victim = self._victim_for(head, batch)
            if victim is None:
                admit = False  # the head waits; running prompts may still use the budget
                continue
            self._preempt(victim, batch)
        self.waiting.put_back()  # (those passed)

    def _seat_for(self, head: Request, batch: ScheduledBatch) -> bool:
        """Whether waiting ``head`` may take a seat: one is free, or a running request ranks low enough to
        give one up."""
        return len(self.running) < self.max_num_seqs or self._victim_for(head, batch) is not None

    def _allocate_running(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for ``n`` more tokens of running ``req``, preempting for them if needed."""
        while not self.block_manager.allocate(req, n):
            victim = self._victim_for_blocks(req, batch)
            self._preempt(victim, batch)
            batch.short_of_blocks = True
            if victim is req:
                return False
        return True

    def _add_drafts(self, batch: ScheduledBatch) -> None:
        """Drafts for the step's decodes (``req.draft_token_ids``), in admission order, with their blocks: as
        many as the token budget leaves after the decodes' and the prompts' tokens (a guess never delays a
        prompt), and none where the blocks are not free (no one is preempted for a guess); none while the
        engine recovers from a step out of memory (``one_at_a_time``): one with drafts is retried without."""
        busy = self.proposer.disable_by_batch_size
        if (busy is not None and len(self.running) > busy) or self.one_at_a_time:
            return
        step_cap = self.block_manager.max_step_tokens  # (a sliding-window pool's bound on one request's step)
        for i in range(batch.num_decodes):  # (the batch's first requests: its decodes, in admission order)
            req = batch.requests[i]
            left = self.max_num_batched_tokens - batch.num_tokens
            if step_cap is not None:
                left = min(left, step_cap - 1)
            drafts = self.proposer.propose(req, left) if left > 0 else []
            if drafts and not self.block_manager.allocate(req, 1 + len(drafts)):
                drafts = []
            batch.add_drafts(i, len(drafts))
            req.draft_token_ids = drafts

    def _order(self) -> Callable[[Request], tuple[float, int]]:
        """Running requests from best to worst: by rank, then the most recently admitted last."""
        admitted = {r.request_id: i for i, r in enumerate(self.running)}
        rank = self.waiting.rank
        return lambda r: (rank(r), admitted[r.request_id])

    def _victim_for_blocks(self, req: Request, batch: ScheduledBatch) -> Request:
        """Who gives up blocks for running ``req``: the worst running request ranked below it, sparing the
        newly preempted if another will do; ``req`` itself when nothing ranks below it."""
        key = self._order()
        worse = [r for r in self.running if key(r) > key(req) and r.request_id not in batch.pinned]
        pool = [r for r in worse if not r.just_preempted] or worse
        return max(pool, key=key) if pool else req

    def _victim_for(self, head: Request, batch: ScheduledBatch) -> Request | None:
        """A running request that may be preempted for waiting ``head``, if any (never but under a policy that
        ``preempts``): one that ranks worse by the queue's margin, or under ``fair`` a client's seat."""
        if not self.waiting.preempts or not self.running:
            return None
        if self.waiting.by_client:
            return self._seat_for_client(head, batch)
        rank, margin = self.waiting.rank, self.waiting.preempt_margin
        if max(map(rank, self.running)) - rank(head) < margin:  # (of all running first: nobody's order needed)
            return None
        candidates = [r for r in self.running if not r.just_preempted and r.request_id not in batch.pinned]
        if not candidates or max(map(rank, candidates)) - rank(head) < margin:
            return None
        return max(candidates, key=self._order())

    def _seat_for_client(self, head: Request, batch: ScheduledBatch) -> Request | None:
        """Under ``fair``: for waiting ``head``, a seat of a client holding at least two more than ``head``'s
        (the most, the most served among equals): its request cheapest to compute again (the latest admitted
        among equals), and only one that costs no more to compute again than ``head`` brings, so that what
        preemptions waste stays below the work they let in. After the move that client holds at least as many
        seats as ``head``'s, so neither takes that seat back while both have requests waiting (a client
        sending one request at a time takes a seat for each, and gives it back when it ends)."""
        seats, at_least = self.waiting.seats, self.waiting.seats(head.client) + 2
        if self.waiting.most_seats() < at_least:  # (most steps of a full server: nobody's order needed)
            return None
        work, block_size = expected_work(head), self.block_manager.block_size

        def again(r: Request) -> int:  # (what is past its blocks in the prefix cache: none without one)
            return r.num_computed_tokens - r.num_cached_blocks * block_size

        candidates = [r for r in self.running if seats(r.client) >= at_least and again(r) <= work
                      and not r.just_preempted and r.request_id not in batch.pinned]
        if not candidates:
            return None
        order = self._order()

        def worst(r: Request) -> tuple:  # (the most seats, then the worst rank, the cheapest, the latest admitted)
            rank, admitted = order(r)
            return seats(r.client), rank, -again(r), admitted

        return max(candidates, key=worst)

    def _add(self, batch: ScheduledBatch, req: Request, n: int) -> None:
        """Schedule ``n`` tokens of ``req``; the full blocks they complete become findable at once."""
        batch.add(req, n)
        self.block_manager.cache_full_blocks(req, req.num_computed_tokens + n)

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Recompute-style preemption: drop its KV and send it back to waiting."""
        if req in batch:
            batch.remove(req)
        self.running.remove(req)
        self.block_manager.free(req)
        self.waiting.preempted(req, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.num_output_at_preemption = req.num_sampled
        self.num_preemptions += 1
        req.status = Status.WAITING
        req.queued_at = self.now
        self.waiting.requeue(req)
        self._queue_time(req)
        self._waiting_embeddings += req.pool is not None
        batch.preempted.append(req)


def _fit_images(req: Request, start: int, n: int, limit: int, cap: int, batch: ScheduledBatch) -> tuple[int, int]:
    """How many of the ``n`` prompt tokens from ``start`` to schedule within the step's ``limit`` and the
    request's ``cap``, and the image positions they begin: a chunk that reaches an image not yet encoded runs
    the vision tower over all of it, a work of the order of as many prompt tokens, so those count against both
    too; the chunk stops before the first image that does not fit (the step's first prompt chunk always takes
    one image: each gets a step)."""
    room = min(cap, limit - batch.num_prompt_tokens - batch.image_tokens)
    n = min(n, room)
    alone = not (batch.num_prompt_tokens or batch.image_tokens)
    cost = reach = 0  # image positions begun; tokens that reach the last of those images
    for i, im in enumerate(req.images):
        if im.offset >= start + n:
            break
        if im.end <= start or i in req.image_embeds:
            continue
        at = max(im.offset - start, 0)
        if at + 1 + cost + im.length > room and not (alone and not cost):
            return min(at, max(room - cost, reach)), cost
        cost += im.length
        reach = at + 1
    return (min(n, max(room - cost, reach)), cost) if cost else (n, 0)


def _context_needed(req: Request) -> int:
    """The KV slots ``req`` needs to take its next step: its tokens, and the one it samples (an
    embedding samples none)."""
    return req.num_tokens + (req.pool is None)


def _cacheable_tokens(req: Request) -> int:
    """How many of ``req``'s leading tokens may come from the prefix cache: all but the last (its logits
    are needed), none whose prompt logprobs are still to be computed, and none where an embedding
    pools every token's state or the first's (or is an encoder's)."""
    if req.pool is not None and req.pool.uncached:
        return 0
    n = req.num_tokens - 1
    done = req.prompt_logprobs_end  # position p's logprob sits at index p + 1
    if req.params.prompt_logprobs is not None and done < req.num_prompt_tokens:
        n = min(n, done - 1)
    return n
