"""The waiting queue, one small class per scheduling policy, chosen once at start.

Every queue orders requests by a *rank* (lower goes first), and the scheduler
uses the same rank for running requests: the best gets prompt tokens first, the
worst is preempted first (the most recently admitted among equals). One order
for both is what guarantees progress: the best-ranked request is never the one
pushed out to make room for others. ``preempts`` says whether a waiting request
may push a running one out: under ``priority`` on rank alone, when it ranks at
least ``preempt_margin`` better (half a level); under ``fair`` (``by_client``)
when its client holds two seats fewer than another client.

Aging, so that nothing starves: every ``aging_seconds`` a request has spent
*waiting* (in total, across preemptions; time running does not count) improves
its rank by one. Waiting requests all age at the same speed, so their order is
fixed when they are queued; a running request's rank stays where it was when it
was admitted, so the waiting ones catch up with it:

- ``fcfs``: rank = arrival. A preempted request goes back to the front.
- ``priority``: rank = priority - waited / aging_seconds: lower priority values
  first (vLLM's convention); waiting ``aging_seconds`` is worth one priority level.
- ``short-first``: rank = log2(expected work) - waited / aging_seconds, where the
  expected work is the prompt tokens still to compute plus the tokens still to
  generate, counted up to ``EXPECTED_OUTPUT_CAP`` (a defaulted ``max_tokens``, the
  rest of the context, says nothing about how long the answer will be):
  waiting ``aging_seconds`` is worth halving it.
- ``fair``: the seats are shared equally between the *clients* with requests
  (``Request.client``: the caller's address, API key or user, as the frontend's
  ``--fair-client`` says), then tokens: a freed seat goes to the client holding
  the fewest, among those to the one served the fewest tokens so far, so that
  one client's hundreds of requests cannot queue everyone else behind them.
  rank = the tokens the client has been served: a virtual token counter (Sheng
  et al., "Fairness in Serving Large Language Models", OSDI '24). A token
  computed in a prompt row counts 1, in a decode row 2 (a generated one), once:
  what a preemption makes the engine compute again, and drafts not kept, are
  free. A client is counted while it has requests in the engine; one that comes
  (back) starts at the least-served active client's count, so that idle time
  earns no credit. No aging: a waiting client's count stands still while the
  others' grow. A client holding two
  seats fewer than another takes one of its seats (the scheduler preempts a
  request of the client holding the most, the most served among equals), so
  that one client's long generations filling every seat do not keep the others
  waiting for one to end; after the move the other still holds as many as it,
  so neither takes that seat back while both have requests waiting.

``aging_seconds`` = inf turns aging off (as in vLLM), at the risk of starvation.
Every queue is told of the steps launched (``served``), of the KV preemptions
drop (``preempted``) and of the requests that end (``finished``); only ``fair``
counts them. Torch-free.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections import Counter, OrderedDict
from collections.abc import Iterator

from engine.config import POLICIES
from engine.request import Request, Status


class Queue:
    """What the scheduler asks of every queue but the order itself."""

    preempts = False
    preempt_margin = 0.0
    by_client = False  # (fair: preempts for a client's share of the seats, not on rank)

    def set_aside(self) -> Request:
        """Take the head out for this step: ``put_back`` returns what was set aside to where it was (kept in
        the queue's ``_aside``; a heap's keeps its entries instead)."""
        self._aside.append(self.pop())
        return self._aside[-1]

    def put_back(self) -> None:
        for req in reversed(self._aside):
            self.requeue(req)
        self._aside.clear()

    def served(self, requests: list[Request], num_new_tokens: list[int], num_decodes: int,
               rejected: dict[str, int] | None = None) -> None:
        """A step launched with ``num_new_tokens`` of each of ``requests`` (the first ``num_decodes`` decode,
        their ``rejected`` drafts by request id not kept)."""

    def preempted(self, req: Request, computed: int) -> None:
        """``req`` lost the KV of its first ``computed`` tokens (preempted, or its step failed): computing them
        again is the scheduler's doing, not more work of the request's."""

    def finished(self, req: Request) -> None:
        """``req`` has left the engine (finished, aborted, timed out), waiting or running."""


class FcfsQueue(Queue):
    """Arrival order; preempted requests go back to the front. Never preempts on rank. An ordered dict, not a
    deque: removing a request (an abort, a deadline) from anywhere in it is O(1), so that a burst of them over a
    long queue is not O(waiting) each."""

    def __init__(self, aging_seconds: float = math.inf) -> None:
        self._q: OrderedDict[Request, None] = OrderedDict()
        self._aside: list[Request] = []
        self.now = 0.0

    def rank(self, req: Request) -> float:
        return req.arrival_time

    def push(self, req: Request) -> None:
        self._q[req] = None

    def requeue(self, req: Request) -> None:
        """A preempted request: it arrived before anything still waiting."""
        self._q[req] = None
        self._q.move_to_end(req, last=False)

    def peek(self) -> Request:
        return next(iter(self._q))

    def pop(self) -> Request:
        return self._q.popitem(last=False)[0]

    def remove(self, req: Request) -> None:
        del self._q[req]

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class RankedQueue(Queue):
    """A heap keyed by (rank, insertion order), with lazy removal.

    Ranks are kept as ``base + (t - waited) / aging_seconds``, with t the time it was
    queued (waiting) or now (running): the same order as ``base - waited_so_far /
    aging_seconds``, shifted by ``now / aging_seconds`` for every request alike.
    """

    def __init__(self, aging_seconds: float) -> None:
        if not aging_seconds > 0:
            raise ValueError(f"aging_seconds must be positive, got {aging_seconds}")
        self.aging_seconds = aging_seconds
        self.now = 0.0  # the scheduler's clock at this step: where running requests' ranks stand
        self._heap: list[list] = []  # [rank, seq, request or None once removed]
        self._entries: dict[str, list] = {}
        self._aside: list[list] = []  # entries set aside for a step, their order kept
        self._seq = itertools.count()

    def base_rank(self, req: Request) -> float:
        raise NotImplementedError

    def rank(self, req: Request) -> float:
        t = req.queued_at if req.status is Status.WAITING else self.now
        return self.base_rank(req) + (t - req.waited) / self.aging_seconds

    def push(self, req: Request) -> None:
        entry = [self.rank(req), next(self._seq), req]
        self._entries[req.request_id] = entry
        heapq.heappush(self._heap, entry)

    requeue = push  # a preempted request keeps what it has waited, so its rank says where it goes

    def peek(self) -> Request:
        while self._heap[0][2] is None:
            heapq.heappop(self._heap)
        return self._heap[0][2]

    def pop(self) -> Request:
        req = self.peek()
        heapq.heappop(self._heap)
        del self._entries[req.request_id]
        return req

    def set_aside(self) -> Request:
        """Take the head out for this step: ``put_back`` returns what was set aside to where it was."""
        req = self.peek()
        self._aside.append(heapq.heappop(self._heap))
        del self._entries[req.request_id]
        return req

    def put_back(self) -> None:
        for entry in self._aside:
            heapq.heappush(self._heap, entry)
            self._entries[entry[2].request_id] = entry
        self._aside.clear()

    def remove(self, req: Request) -> None:
        self._entries.pop(req.request_id)[2] = None
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._entries):  # drop the tombstones
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._entries.values()))


class PriorityQueue(RankedQueue):
    preempts = True
    # A waiting request preempts a running one only when it ranks at least half a level better: one
    # priority level more urgent (less what the running one had earned by waiting), or equal but having
    # waited ``aging_seconds / 2`` longer: equals take turns no faster than that.
    preempt_margin = 0.5

    def rank(self, req: Request) -> float:  # (the base, the priority, inlined: a full server's step ranks every
        t = req.queued_at if req.status is Status.WAITING else self.now  # running request for a victim)
        return req.priority + (t - req.waited) / self.aging_seconds


class ShortFirstQueue(RankedQueue):
    def base_rank(self, req: Request) -> float:
        return math.log2(max(1, expected_work(req)))


REFRESH_ONE_BY_ONE = 8  # out-of-date heap tops a peek brings up to date one at a time, before all of them at once


class FairQueue(Queue):
    """Each client's requests in arrival order (preempted ones back at the front), the clients in a heap keyed
    by (seats held, tokens served, their head's arrival), with lazy removal: an entry is dead once its
    client's seats or head have changed, and its client keyed anew. Tokens served only grow, so a step's
    serving re-keys nobody: an entry is a lower bound of its client's key, brought up to date when it comes
    to the heap's top (at 256 clients with requests waiting, each step re-keyed them all). Seats first, as
    the scheduler preempts by them: no seat is given to be taken back the next step."""

    preempts = by_client = True
    # a running request's prompt takes its chunk before a waiting one of a client served less, unless that
    # one's client was served this many tokens less: equals' long prompts are not all started at once
    preempt_margin = 2048.0

    def __init__(self, aging_seconds: float = math.inf) -> None:
        self.now = 0.0
        self._served: dict[str, float] = {}  # client -> tokens served, while it has requests in the engine
        self._held: dict[str, int] = {}  # client -> its requests in the engine (waiting or running)
        self._seats: dict[str, int] = {}  # client -> its running requests (admitted, not yet preempted or ended)
        self._holding: Counter[int] = Counter()  # k -> the clients holding k seats (k > 0)
        self._most = 0  # the most seats a client holds
        self._waiting: dict[str, OrderedDict[Request, None]] = {}  # client -> its waiting requests, in order
        self._heap: list[list] = []  # [seats held, served, head's arrival, seq, client, live]
        self._entry: dict[str, list] = {}  # client -> its live entry (clients with requests waiting)
        self._aside: list[Request] = []
        self._redo: dict[Request, int] = {}  # a preempted request -> the tokens it had computed (computed again free)
        self._len = 0
        self._seq = itertools.count()

    def rank(self, req: Request) -> float:
        return self._served.get(req.client, 0.0)

    def seats(self, client: str) -> int:
        """How many of ``client``'s requests run."""
        return self._seats.get(client, 0)

    def most_seats(self) -> int:
        return self._most

    def push(self, req: Request) -> None:
        c = req.client
        if c not in self._held:  # (back) with nothing in the engine: level with the least served
            self._served[c] = min(self._served.values(), default=0.0)
            self._held[c] = 0
        self._held[c] += 1
        self._waiting.setdefault(c, OrderedDict())[req] = None
        self._len += 1
        self._rekey(c)

    def requeue(self, req: Request) -> None:
        """A preempted (or set aside) request: back at the front of its client's."""
        c = req.client
        q = self._waiting.setdefault(c, OrderedDict())
        q[req] = None
        q.move_to_end(req, last=False)
        self._len += 1
        self._rekey(c)

    def peek(self) -> Request:
        heap, served, refreshed = self._heap, self._served, 0
        while True:
            top = heap[0]
            if not top[5]:
                heapq.heappop(heap)
            elif top[1] != served[top[4]]:  # served since it was keyed: its count brought up to date, in place
                refreshed += 1
                if refreshed > REFRESH_ONE_BY_ONE:  # most are out of date (a step served them all): all at once
                    for entry in self._entry.values():
                        entry[1] = served[entry[4]]
                    heap = self._heap = [e for e in heap if e[5]]
                    heapq.heapify(heap)
                    continue
                top[1] = served[top[4]]
                heapq.heapreplace(heap, top)
            else:  # (every other entry's count is at least its own)
                return next(iter(self._waiting[top[4]]))

    def pop(self) -> Request:
        """The head, admitted: it holds a seat."""
        req = self.peek()
        self._seat(req.client)
        self._take(req)
        return req

    def set_aside(self) -> Request:
        self._aside.append(req := self.peek())
        self._take(req)
        return req

    def remove(self, req: Request) -> None:
        self._take(req)

    def served(self, requests: list[Request], num_new_tokens: list[int], num_decodes: int,
               rejected: dict[str, int] | None = None) -> None:
        decodes, redo = requests[:num_decodes], self._redo
        if rejected:  # (a step with drafts: it has each drafting request's count; their kept tokens only)
            counts: Counter[str] = Counter()
            for req, n in zip(decodes, num_new_tokens, strict=False):
                counts[req.client] += n - rejected.get(req.request_id, 0)
        else:
            counts = Counter(map(CLIENT, decodes))  # (one token each)
        if redo:  # (a decode of a request back from a preemption may still be below where it had come)
            for req, n in zip(decodes, num_new_tokens, strict=False):
                if req in redo:
                    counts[req.client] -= self._again(req, n)
        served = self._served  # (entries keep their counts: peek brings the top's up to date)
        for c, n in counts.items():
            if c in served:  # (always, but for one that ended with its step in flight: gone, and forgotten)
                served[c] += 2 * n  # (a generated token counts twice)
        for req, n in zip(requests[num_decodes:], num_new_tokens[num_decodes:], strict=True):
            if redo and req in redo:
                n -= self._again(req, n)
            if (c := req.client) in served:
                served[c] += n

    def _again(self, req: Request, n: int) -> int:
        """Of the ``n`` tokens a step computed for ``req``, those it had computed before its preemption."""
        end, had = req.num_computed_tokens, self._redo[req]  # (the step computed [end - n, end))
        if end >= had:
            del self._redo[req]
        return max(0, min(end, had) - (end - n))

    def preempted(self, req: Request, computed: int) -> None:
        self._redo[req] = max(computed, self._redo.get(req, 0))
        self._unseat(req.client)  # (requeued next, which re-keys its client)

    def finished(self, req: Request) -> None:
        self._redo.pop(req, None)
        c = req.client
        if req.status is Status.RUNNING:
            self._unseat(c)
            if c in self._entry:  # (a client with requests waiting: one seat fewer)
                self._rekey(c)
        left = self._held.get(c, 0) - 1
        if left > 0:
            self._held[c] = left
        elif c in self._held:
            del self._held[c], self._served[c]

    def _seat(self, c: str) -> None:
        k, holding = self._seats.get(c, 0) + 1, self._holding
        self._seats[c] = k
        holding[k] += 1
        if k > 1:
            holding[k - 1] -= 1
        self._most = max(self._most, k)

    def _unseat(self, c: str) -> None:
        k, holding = self._seats[c], self._holding
        if k > 1:
            self._seats[c] = k - 1
        else:
            del self._seats[c]
        holding[k] -= 1
        if k > 1:
            holding[k - 1] += 1
        if k == self._most and not holding[k]:  # (the last client holding the most: it holds one fewer)
            self._most = k - 1

    def _take(self, req: Request) -> None:
        c = req.client
        q = self._waiting[c]
        del q[req]
        self._len -= 1
        if not q:
            del self._waiting[c]
        self._rekey(c)

    def _rekey(self, c: str) -> None:
        """Client ``c``'s entry anew: its seats, count or head changed (none once nothing of it waits)."""
        old = self._entry.pop(c, None)
        if old is not None:
            old[5] = False
        q = self._waiting.get(c)
        if q:
            entry = [self._seats.get(c, 0), self._served[c], next(iter(q)).arrival_time, next(self._seq), c, True]
            self._entry[c] = entry
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._entry):  # drop the stale entries
            self._heap = [e for e in self._heap if e[5]]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        served = self._served
        for entry in sorted(self._entry.values(), key=lambda e: (e[0], served[e[4]], *e[2:4])):
            yield from self._waiting[entry[4]]


CLIENT = operator.attrgetter("client")  # (a request's client)
EXPECTED_OUTPUT_CAP = 512


def expected_work(req: Request) -> int:
    """Prompt tokens still to compute plus tokens still to generate (up to ``EXPECTED_OUTPUT_CAP``)."""
    to_compute = req.num_tokens - req.num_computed_tokens
    return to_compute + min(EXPECTED_OUTPUT_CAP, max(0, req.params.max_tokens - len(req.output_token_ids)))


def make_queue(policy: str, aging_seconds: float) -> Queue:
    queues = {"fcfs": FcfsQueue, "priority": PriorityQueue, "short-first": ShortFirstQueue, "fair": FairQueue}
    if policy not in queues:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return queues[policy](aging_seconds)
