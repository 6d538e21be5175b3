"""Data parallel on the frontend's side: several engines behind ``EngineClient``'s interface.

``EngineRouter`` holds one ``EngineClient`` per engine (each its own DEALER, handshake
and health) and is what ``OpenAIApi``, ``Generation`` and the WebSocket endpoint talk
to when there is more than one engine.

- A new call goes to the least-loaded healthy engine: its load is this frontend's own
  requests in flight there plus the other frontends' share of its latest STATS
  (running + waiting, less what was ours when that STATS came: an engine sends them
  whenever its requests come or go, ``engine.server.LOAD_S``), KV usage breaking
  ties, then round robin. All requests that share a ``Stream`` (the n choices and the
  prompts of one API call) go to the same engine, so prefix caching shares their
  blocks.
- A call with an affinity key (OpenAI's ``prompt_cache_key``: a conversation's, a
  tenant's) goes to the engine the key hashes to (rendezvous hashing over the healthy
  engines: a key moves only when its engine goes), so that its turns find their prefix
  in that engine's cache, unless that engine holds more than ``max_num_seqs // 8``
  (at least 1) requests more than the least loaded: then to that one, as SGLang's
  cache-aware router falls back to the shortest queue. (Each frontend weighs the
  others' requests by the STATS it last saw: with several frontends, one key's
  burst can pass the slack by what they sent in the last ``LOAD_S``.)
- An abort goes to the engine that owns the request (each client knows its own).
- A LoRA update goes to every engine. An engine that comes back (a remote one
  restarted) has lost the adapters loaded while serving: it is given those every
  other engine serves, from their folders, so that a call may still go to any.
- An engine that dies or hangs fails only its own in-flight requests (503, from its
  client); new calls go to the others, and to one that is ``stalled`` (unanswered for
  long: ``EngineClient.stalled``) only while every engine is. ``healthy`` holds while
  one engine does; ``engines_health()`` is the per-engine view ``/health`` shows
  ("degraded").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging

from engine.protocol import ImageInput, LoraUpdate, PoolingParams, Ready, SamplingParams, Stats
from frontends.engine_client import EngineClient, EngineUnavailable, Stream

log = logging.getLogger("tokenmill.engine_router")


def combined_stats(stats: list[Stats]) -> Stats:
    """Several engines' STATS as one: counts summed, KV usage over all blocks, rates averaged."""
    blocks = sum(s.num_kv_blocks for s in stats)
    free = sum(s.num_free_blocks for s in stats)
    n = max(1, len(stats))
    return Stats(
        num_waiting=sum(s.num_waiting for s in stats), num_running=sum(s.num_running for s in stats),
        kv_usage=(1.0 - free / blocks) if blocks else sum(s.kv_usage for s in stats) / n,
        num_free_blocks=free, num_kv_blocks=blocks,
        num_preemptions=sum(s.num_preemptions for s in stats), num_timeouts=sum(s.num_timeouts for s in stats),
        prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / n,
        num_evictions=sum(s.num_evictions for s in stats),
        kv_fragmentation=sum(s.kv_fragmentation for s in stats) / n,
        num_spec_drafts=sum(s.num_spec_drafts for s in stats),
        num_spec_draft_tokens=sum(s.num_spec_draft_tokens for s in stats),
        num_spec_accepted_tokens=sum(s.num_spec_accepted_tokens for s in stats))


class EngineRouter:
    """``EngineClient``'s interface over several engines (see the module doc)."""

    def __init__(self, clients: list[EngineClient], dead: list[int] | None = None) -> None:
        """``dead``: indices of engines known to be gone (a frontend restarted while one is down):
        never connected, shown as unavailable, so the others serve without waiting for them."""
        if not clients:
            raise ValueError("an EngineRouter needs at least one engine")
        self.clients = clients
        self.dead = set(dead or ())
        if len(self.dead) >= len(clients):
            raise ValueError("an EngineRouter needs at least one live engine")
        self._ready: Ready | None = None  # the engines' terms, agreed at connect
        self._readies: tuple = ()  # the clients' READYs ``ready`` was last made of, and it:
        self._ready_now: Ready | None = None
        self._next = 0  # round robin among equally loaded engines
        self._lora_updates = asyncio.Lock()  # one at a time: two racing could leave the engines disagreeing
        self._tasks: set[asyncio.Task] = set()  # (held: the loop keeps only weak references to tasks)
        for c in clients:
            c.on_back = functools.partial(self._came_back, c)

    # ------------------------------------------------------------------ lifecycle

    async def connect(self) -> Ready:
        """Handshake with every engine; they must serve the same model (vocabulary, EOS) and the same LoRA
        adapters (names: a call may go to any engine)."""
        live = [c for i, c in enumerate(self.clients) if i not in self.dead]
        results = await asyncio.gather(*(c.connect() for c in live), return_exceptions=True)
        failed = [(c, r) for c, r in zip(live, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            await self.close()
            c, e = failed[0]
            if isinstance(e, EngineUnavailable):
                raise EngineUnavailable(f"engine {self.clients.index(c)} ({c.address}): {e}")
            raise e
        first = results[0]
        for c, r in zip(live[1:], results[1:], strict=True):
            if (r.model, r.vocab_size, sorted(r.eos_token_ids), r.labels) != (
                    first.model, first.vocab_size, sorted(first.eos_token_ids), first.labels):
                await self.close()
                raise EngineUnavailable(f"{c.address} serves {r.model!r} (vocabulary {r.vocab_size}), "
                                        f"{live[0].address} {first.model!r} (vocabulary {first.vocab_size}): "
                                        "data parallel needs one model")
            names, first_names = sorted(name for name, _ in r.loras), sorted(name for name, _ in first.loras)
            if names != first_names and r.max_loras and first.max_loras:  # (loaded while serving: see ready)
                log.warning("%s serves the LoRA adapters %s, %s %s: only those every engine serves are asked for",
                            c.address, names, live[0].address, first_names)
            elif names != first_names:
                await self.close()
                raise EngineUnavailable(f"{c.address} serves the LoRA adapters {names}, {live[0].address} "
                                        f"{first_names}: data parallel needs the same adapters on every engine")
        # one call runs on one engine: it must fit the smallest
        self._ready = dataclasses.replace(
            first, max_model_len=min(r.max_model_len for r in results),
            max_num_waiting_requests=min(r.max_num_waiting_requests for r in results),
            max_num_seqs=min(r.max_num_seqs for r in results), max_loras=min(r.max_loras for r in results))
        return self.ready

    @property
    def ready(self) -> Ready | None:
        """The terms every engine meets, the LoRA adapters those it can reach serve now (``update_lora``)."""
        readies = tuple(c.ready for c in self.clients if c.healthy and c.ready is not None)
        if self._ready is None or not readies:
            return self._ready
        if readies != self._readies:
            names = set.intersection(*({name for name, _ in r.loras} for r in readies))
            self._readies = readies
            self._ready_now = dataclasses.replace(self._ready, loras=[a for a in readies[0].loras if a[0] in names])
        return self._ready_now

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, *(c.close() for c in self.clients), return_exceptions=True)

    # ------------------------------------------------------------------ health

    @property
    def healthy(self) -> bool:
        return any(c.healthy for c in self.clients)

    @property
    def accepting(self) -> bool:
        return any(c.accepting for c in self.clients)

    @property
    def stalled(self) -> bool:
        """Every engine taking new calls is stalled (``EngineClient.stalled``)."""
        return all(c.stalled for c in self.clients if c.accepting)

    def unanswered(self) -> float:
        """The shortest time any engine taking new calls has not answered for."""
        return min((c.unanswered() for c in self.clients if c.accepting), default=0.0)

    @property
    def last_stats(self) -> Stats | None:
        stats = [c.last_stats for c in self.clients if c.healthy and c.last_stats is not None]
        return combined_stats(stats) if stats else None

    def engines_health(self) -> list[dict]:
        """Per engine: index, ok / stalled (with the seconds it has not answered for) / draining / unavailable,
        and its latest numbers (no address: /health is open)."""
        out = []
        for i, c in enumerate(self.clients):
            e = {"engine": i, "status": "draining" if c.healthy and c.draining else "stalled" if c.stalled else
                 "ok" if c.healthy else "unavailable"}
            if e["status"] == "stalled":
                e["unanswered_s"] = round(c.unanswered(), 1)
            if c.healthy and c.last_stats is not None:
                s = c.last_stats
                e.update(num_waiting=s.num_waiting, num_running=s.num_running, kv_usage=s.kv_usage)
            out.append(e)
        return out

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    # ------------------------------------------------------------------ requests

    def load(self, i: int) -> tuple[float, float]:
        """Engine ``i``'s load as the router ranks it: (requests, KV usage)."""
        c = self.clients[i]
        s = c.last_stats
        if s is None:
            return float(c.num_in_flight), 0.0
        others = max(0, s.num_running + s.num_waiting - c.in_flight_at_stats)
        return float(c.num_in_flight + others), s.kv_usage

    def pick(self, affinity: str = "") -> int:
        """The least-loaded healthy engine (not stalled, while one is not), or ``affinity``'s while it is not much
        busier (module doc); ``EngineUnavailable`` when none is healthy."""
        n = len(self.clients)
        taking = [c.accepting for c in self.clients]
        answering = [t and not c.stalled for t, c in zip(taking, self.clients, strict=True)]
        if any(answering):  # (else every engine taking calls is stalled: ``stalled``)
            taking = answering
        best, best_load = None, None
        for k in range(n):
            i = (self._next + k) % n
            if not taking[i]:
                continue
            load = self.load(i)
            if best_load is None or load < best_load:
                best, best_load = i, load
        if best is None:
            raise EngineUnavailable("no engine is available")
        if affinity:
            home = max((i for i in range(n) if taking[i]),  # (by address: frontends agree)
                       key=lambda i: hashlib.blake2b(f"{self.clients[i].address}:{affinity}".encode(),
                                                     digest_size=8).digest())
            slack = max(1, (self._ready.max_num_seqs if self._ready is not None else 8) // 8)
            if self.load(home)[0] <= best_load[0] + slack:
                return home
        self._next = (best + 1) % n
        return best

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0, deadline: float | None = None, stream: Stream | None = None,
            cache_salt: str = "", pooling: PoolingParams | None = None, lora: str = "",
            images: list[ImageInput] | None = None, admitted: bool = False, client_id: str = "") -> Stream:
        """As ``EngineClient.add``; requests sharing ``stream`` go to the engine its first one went to."""
        if stream is None:
            stream = Stream()
        if stream.engine is None:
            stream.engine = self.pick(stream.affinity)
        return self.clients[stream.engine].add(request_id, prompt_token_ids, params, priority, deadline,
                                               stream=stream, cache_salt=cache_salt, pooling=pooling, lora=lora,
                                               images=images, admitted=admitted, client_id=client_id)

    def fail_all(self, message: str) -> None:
        for c in self.clients:
            c.fail_all(message)

    def abort(self, request_ids: list[str]) -> None:
        for c in self.clients:  # each sends only the ids it owns, and nothing when it owns none
            c.abort(request_ids)

    async def update_lora(self, name: str, path: str | None, timeout: float = 120.0) -> LoraUpdate:
        """As ``EngineClient.update_lora``, on every engine it can reach, one update at a time: an adapter loaded
        on only some of them is unloaded from those again (a call may go to any), and the first refusal answers.
        (Other frontend processes update on their own: racing updates of one name through two of them can leave
        an engine holding an adapter the others do not, which ``ready`` then leaves out.)"""
        async with self._lora_updates:
            return await self._update_lora(name, path, timeout)

    async def _update_lora(self, name: str, path: str | None, timeout: float) -> LoraUpdate:
        live = self._accepting()
        if path is not None and (lack := [c for c in live if [name, path] not in c.ready.loras]):
            live = lack  # (the others serve it already: an engine that came back lacking it, and not given it)
        answers = await asyncio.gather(*(c.update_lora(name, path, timeout) for c in live), return_exceptions=True)
        done = [(c, a) for c, a in zip(live, answers, strict=True) if isinstance(a, LoraUpdate) and a.status == 200]
        refused = [a for a in answers if not (isinstance(a, LoraUpdate) and a.status == 200)]
        if not refused or (path is None and done):  # (an unload: done wherever it was loaded)
            return done[0][1]
        if path is not None and done:
            await asyncio.gather(*(c.update_lora(name, None, timeout) for c, _ in done), return_exceptions=True)
        if isinstance(refused[0], BaseException):
            raise refused[0]
        return refused[0]

    def _accepting(self) -> list[EngineClient]:
        """The engines taking new work (``EngineUnavailable`` when none is)."""
        live = [c for c in self.clients if c.accepting]
        if not live:
            raise EngineUnavailable("no engine is available")
        return live

    def _came_back(self, client: EngineClient) -> None:
        task = asyncio.get_running_loop().create_task(self._give_adapters(client))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _give_adapters(self, client: EngineClient) -> None:
        """An engine that came back gets the LoRA adapters every other engine serves and it lacks, from their
        folders (another frontend may give them first: its "already loaded" is no failure)."""
        async with self._lora_updates:
            others = [c.ready for c in self.clients if c is not client and c.accepting and c.ready is not None]
            if not others or not client.accepting:
                return
            served = set.intersection(*({tuple(a) for a in r.loras} for r in others))
            for name, path in sorted(served):
                if (own := dict(client.ready.loras).get(name)) is not None:  # (given already, or its own by the name)
                    if own != path:
                        log.warning("the engine at %s came back serving the LoRA adapter %r from %s, the others from "
                                    "%s: a call for it may get either", client.address, name, own, path)
                    continue
                try:
                    answer = await client.update_lora(name, path)
                except EngineUnavailable:
                    return
                if answer.status == 200:
                    log.info("the engine at %s came back without the LoRA adapter %r: loaded it again from %s",
                             client.address, name, path)
                elif name not in dict(client.ready.loras):
                    log.warning("the engine at %s came back without the LoRA adapter %r, and could not load it "
                                "again (%s): it is not served until it is loaded anew", client.address,
                                name, answer.message)

    async def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        """As ``EngineClient.reset_prefix_cache``, on every engine it can reach: whether all of them did (those
        running no request do, whatever the others answer)."""
        live = self._accepting()
        return all(await asyncio.gather(*(c.reset_prefix_cache(timeout) for c in live)))

    async def stats(self, timeout: float = 5.0) -> Stats:
        live = self._accepting()
        results = await asyncio.gather(*(c.stats(timeout) for c in live), return_exceptions=True)
        stats = [r for r in results if isinstance(r, Stats)]
        if not stats:
            raise EngineUnavailable(f"no engine answered: {results[0]!r}")
        return combined_stats(stats)
