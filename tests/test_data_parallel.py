"""Data parallel and remote engines, fast: the frontend's router over fake engines, and the
CURVE authentication of a tcp:// engine (run_engine with a fake engine in a thread).

The real thing (``tokenmill serve -dp 2``, ``tokenmill engine --listen``) is in
``tests/test_data_parallel_e2e.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from engine import protocol as p
from engine.config import EngineConfig
from engine.protocol import wants_ipv6
from engine.server import run_engine
from frontends.engine_client import EngineClient, EngineUnavailable, Stream
from frontends.engine_router import EngineRouter, combined_stats
from frontends.metrics import Metrics
from tests.test_server_actor import FakeEngine as ActorFakeEngine
from tools.fake_engine import MODEL, VOCAB, FakeEngine, free_port

KEY = "test-engine-key-0123456789"


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def two_engines(tmp_path):
    engines = [FakeEngine(f"ipc://{tmp_path}/e{i}.sock", step_delay=0.01) for i in range(2)]
    for e in engines:
        e.start()
    yield engines
    for e in engines:
        e.stop()


def router_for(engines, name: str = "fe-test", liveness_interval: float = 0.1, **kw) -> EngineRouter:
    # (a generous handshake: the fake engines are threads of this process, slow to answer on a loaded machine)
    return EngineRouter([EngineClient(e.address, name, handshake_timeout=30, liveness_interval=liveness_interval, **kw)
                         for e in engines])


async def until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def drain(stream: Stream, ids: set[str]) -> dict[str, list]:
    """Every item per request id until each has finished or failed."""
    out: dict[str, list] = {r: [] for r in ids}
    left = set(ids)
    while left:
        for item in await asyncio.wait_for(stream.next_batch(), 10):
            out[item.request_id].append(item)
            if isinstance(item, p.Error) or item.finish_reason is not None:
                left.discard(item.request_id)
    return out


def test_router_spreads_calls_and_keeps_a_calls_choices_together(two_engines):
    async def main():
        router = router_for(two_engines)
        await router.connect()
        params = p.SamplingParams(max_tokens=20, temperature=0)
        streams = []
        for call in range(6):  # one call = one stream, n = 2 choices
            s = Stream()
            for c in range(2):
                router.add(f"call{call}-{c}", [1, 2, 3, call], params, stream=s)
            streams.append(s)
        await until(lambda: sum(len(e.adds) for e in two_engines) == 12)
        engine_of = {}
        for e_idx, e in enumerate(two_engines):
            for add in e.adds:
                engine_of[add.request_id] = e_idx
        assert len(engine_of) == 12
        for call in range(6):  # both choices of a call on one engine (their prefix blocks are shared)
            assert engine_of[f"call{call}-0"] == engine_of[f"call{call}-1"] == streams[call].engine
        assert [len(e.adds) for e in two_engines] == [6, 6]  # least loaded: evenly spread
        for call, s in enumerate(streams):
            got = await drain(s, {f"call{call}-0", f"call{call}-1"})
            assert all(items[-1].finish_reason == "length" for items in got.values())
        await router.close()

    run(main())


def test_router_picks_the_least_loaded_engine_by_stats(two_engines):
    async def main():
        router = router_for(two_engines)
        await router.connect()
        busy = router.clients[0]
        # another frontend keeps engine 0 busy: 5 running, 3 waiting, none of them ours
        busy.last_stats, busy.in_flight_at_stats = p.Stats(num_waiting=3, num_running=5, kv_usage=0.5), 0
        router.clients[1].last_stats, router.clients[1].in_flight_at_stats = p.Stats(num_running=1), 0
        params = p.SamplingParams(max_tokens=50, temperature=0)
        picks = [router.add(f"r{i}", [5, 6], params).engine for i in range(8)]
        # engine 1 (load 1) takes requests until its load meets engine 0's (8)
        assert picks[:7] == [1] * 7
        assert router.load(0) == (8.0, 0.5)
        router.abort([f"r{i}" for i in range(8)])
        await until(lambda: sum(len(e.aborts) for e in two_engines) == 8)
        assert sorted(two_engines[1].aborts) == sorted(f"r{i}" for i in range(8) if picks[i] == 1)
        assert sorted(two_engines[0].aborts) == sorted(f"r{i}" for i in range(8) if picks[i] == 0)
        await router.close()

    run(main())


def test_a_prompt_cache_key_keeps_a_conversation_on_one_engine(two_engines):
    """OpenAI's ``prompt_cache_key``: a call with a key goes to the engine the key hashes to, whatever the round
    robin says, while that engine holds at most ``max_num_seqs // 8`` (at least 1) requests more than the least
    loaded; keys spread over the engines; calls without one are placed by load alone."""
    async def main():
        router = router_for(two_engines)
        await router.connect()
        slack = max(1, router.ready.max_num_seqs // 8)
        homes = {key: router.pick(key) for key in (f"conv-{i}" for i in range(40))}
        assert set(homes.values()) == {0, 1}  # (keys spread)
        for key, home in list(homes.items())[:6]:
            assert {router.pick(key) for _ in range(5)} == {home}  # (a key stays)
        key = "conv-0"
        home, other = homes[key], 1 - homes[key]
        for busy in (slack, slack + 1):  # the home engine busier by the slack: still home; by more: the other
            router.clients[home].last_stats, router.clients[home].in_flight_at_stats = p.Stats(num_running=busy), 0
            router.clients[other].last_stats, router.clients[other].in_flight_at_stats = p.Stats(), 0
            assert router.pick(key) == (home if busy <= slack else other)
        assert router.pick("") == other  # (no key: the least loaded)
        await router.close()

    run(main())


def test_served_prompt_cache_key_finds_its_prefix_in_one_engines_cache(tmp_path, smollm_tokenizer_dir):
    """Through a frontend over two engines: each conversation's turns, sent with its ``prompt_cache_key``, all go to
    one engine, and every turn after the first finds its earlier turns cached there; without the key the turns
    alternate between the engines and half of them find nothing."""
    import openai

    from tools.fake_engine import KEY as API_KEY
    from tools.fake_engine import MODEL, start_frontend, stop_frontend

    engines = [FakeEngine(f"ipc://{tmp_path}/c{i}.sock") for i in range(2)]
    for e in engines:
        e.start()
    port = free_port()
    proc = start_frontend([e.address for e in engines], smollm_tokenizer_dir, port,
                          responses_store=str(tmp_path / "responses.sqlite"))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
        cached = {}
        for keyed in (True, False):
            for e in engines:
                e.prefix_cache.reset()
            hits, places = [], []
            messages = [{"role": "system", "content": "You answer questions. " * 20}]
            for turn in range(6):
                messages.append({"role": "user", "content": f"Question {turn}: " + "lorem ipsum " * 10})
                before = [len(e.adds) for e in engines]
                r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                   **({"prompt_cache_key": "conv-1"} if keyed else {}))
                places.append([len(e.adds) for e in engines] != before and
                              next(i for i, e in enumerate(engines) if len(e.adds) > before[i]))
                hits.append(r.usage.prompt_tokens_details.cached_tokens)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
            cached[keyed] = hits
            if keyed:
                assert len(set(places)) == 1 and all(h > 0 for h in hits[1:]), (places, hits)
                home = places[0]
            else:
                assert len(set(places)) == 2 and sum(h == 0 for h in hits) >= 2, (places, hits)
        assert sum(cached[True]) > sum(cached[False])
        # a beam search's rounds (a call each) all go to its first round's engine, the key's where it has one
        for extra in ({"prompt_cache_key": "conv-1"}, {}):
            before = [len(e.adds) for e in engines]
            client.completions.create(model=MODEL, prompt="the cat sat on", n=2, max_tokens=4,
                                      extra_body={"use_beam_search": True, **extra})
            got = [len(e.adds) - b for e, b in zip(engines, before, strict=True)]
            assert sorted(got)[0] == 0 and sum(got) > 2, got  # (review: the rounds were spread)
            if extra:
                assert got[home] > 0
        # a Responses conversation continued by previous_response_id stays on one engine (its first Response's id
        # is its key), and finds its earlier turns cached there
        for e in engines:
            e.prefix_cache.reset()
        previous, places, hits = None, [], []
        for turn in range(6):
            before = [len(e.adds) for e in engines]
            r = client.responses.create(model=MODEL, input=f"Question {turn}: " + "lorem ipsum " * 10,
                                        instructions="You answer questions. " * 20, max_output_tokens=2,
                                        previous_response_id=previous)
            places.append(next(i for i, e in enumerate(engines) if len(e.adds) > before[i]))
            hits.append(r.usage.input_tokens_details.cached_tokens)
            previous = r.id
        assert len(set(places)) == 1 and all(h > 0 for h in hits[1:]), (places, hits)
        conversation = client.conversations.create(items=[{"type": "message", "role": "system",
                                                           "content": "You answer questions. " * 20}])
        places = []  # and a stored conversation's: its id is its key
        for turn in range(6):
            before = [len(e.adds) for e in engines]
            client.responses.create(model=MODEL, input=f"Question {turn}: " + "lorem ipsum " * 10, max_output_tokens=2,
                                    conversation=conversation.id)
            places.append(next(i for i, e in enumerate(engines) if len(e.adds) > before[i]))
        assert len(set(places)) == 1, places
    finally:
        assert stop_frontend(proc) == 0
        for e in engines:
            e.stop()


def test_router_refuses_engines_with_different_lora_adapters(two_engines):
    """A call naming an adapter may go to any engine: every engine must serve the same ones (paths may differ);
    where adapters are loaded while serving, the router serves those every engine has."""
    two_engines[0].loras = [["sql", "/a/sql"], ["chat", "/a/chat"]]
    two_engines[1].loras = [["chat", "/b/chat"], ["sql", "/b/sql"]]

    async def connect():
        router = router_for(two_engines)
        try:
            return await router.connect()
        finally:
            await router.close()

    assert [name for name, _ in run(connect()).loras] == ["sql", "chat"]
    two_engines[1].loras = [["sql", "/b/sql"]]
    with pytest.raises(EngineUnavailable, match=r"the LoRA adapters \['sql'\], .* \['chat', 'sql'\]: data parallel "
                                                r"needs the same adapters"):
        run(connect())
    for e in two_engines:  # adapters loaded while serving: an engine that restarted lost them; serve those all have
        e.max_loras = 4
    assert run(connect()).loras == [["sql", "/a/sql"]]


def test_a_frontend_reconnecting_under_its_identity_is_answered_before_its_old_connection_is_gone(two_engines):
    """As the real engine, the fake one hands an identity over to a new connection: without that, a client that
    connects again under its identity before the engine has seen its old connection close (these tests' routers,
    on a loaded machine) was never read, and its handshake waited out its timeout. Closing at once works too."""

    async def main():
        old = EngineClient(two_engines[0].address, "fe-test", handshake_timeout=3)
        await old.connect()
        new = EngineClient(two_engines[0].address, "fe-test", handshake_timeout=3)
        await new.connect()  # the old connection is still open
        for c in (new, old):
            await c.close()
        for _ in range(5):  # closed right after its handshake: its tasks never ran (close used to hang in term())
            c = EngineClient(two_engines[0].address, "fe-test", handshake_timeout=3)
            await c.connect()
            await c.close()

    run(main())


def test_router_loads_an_adapter_on_every_engine_or_on_none(two_engines):
    """A LoRA update goes to every engine; ``ready.loras`` names what all of them serve. A load one engine refuses
    is undone on the others (a call may go to any), and the refusal answers; an unload is done where it can be."""

    async def main():
        router = router_for(two_engines)
        await router.connect()
        try:
            answer = await router.update_lora("sql", "/a/sql")
            assert answer.status == 200 and [e.loras for e in two_engines] == [[["sql", "/a/sql"]]] * 2
            assert router.ready.loras == [["sql", "/a/sql"]]
            two_engines[1].lora_refusal = "no free LoRA slot"
            answer = await router.update_lora("chat", "/a/chat")
            assert (answer.status, answer.message) == (400, "no free LoRA slot")
            assert [e.loras for e in two_engines] == [[["sql", "/a/sql"]]] * 2
            await until(lambda: router.ready.loras == [["sql", "/a/sql"]])
            two_engines[1].loras = []  # (an engine restarted: it lost what was loaded while serving)
            answer = await router.update_lora("sql", None)
            assert answer.status == 200 and two_engines[0].loras == []
            assert (await router.update_lora("sql", None)).status == 404
        finally:
            await router.close()

    run(main())


def test_an_engine_that_comes_back_is_given_the_adapters_the_others_serve(two_engines, caplog):
    """A (remote) engine restarted has lost the adapters loaded while serving: they vanished from the list the
    frontends serve (the others' and its own in common), and loading one again was refused ("already loaded", by the
    others). The frontend gives it what every other engine serves; one it cannot give can be loaded again."""
    caplog.set_level("INFO", "tokenmill.engine_router")
    for e in two_engines:
        e.max_loras = 2

    async def main():
        router = router_for(two_engines)
        await router.connect()
        try:
            assert (await router.update_lora("sql", "/a/sql")).status == 200
            for refusal in (None, "no free LoRA slot"):
                await _restart(two_engines, router.clients[1], max_loras=2, lora_refusal=refusal)
                await until(lambda: router.clients[1].healthy, 10)
                if refusal is None:
                    await until(lambda: two_engines[-1].loras == [["sql", "/a/sql"]])
                    # (logged once the engine's answer is read: the fake engine holds the adapter a moment before)
                    await until(lambda: "came back without the LoRA adapter 'sql': loaded it again" in caplog.text)
                else:
                    await until(lambda: "could not load it again (no free LoRA slot)" in caplog.text)
                    assert router.ready.loras == []
                    two_engines[-1].lora_refusal = None
                    assert (await router.update_lora("sql", "/a/sql")).status == 200  # (on the one lacking it)
                await until(lambda: router.ready.loras == [["sql", "/a/sql"]])
                assert two_engines[0].loras == [["sql", "/a/sql"]]
            # back with an adapter of that name from another folder (its --lora-modules): said (review S)
            await _restart(two_engines, router.clients[1], max_loras=2, loras=[["sql", "/b/sql"]])
            await until(lambda: "serving the LoRA adapter 'sql' from /b/sql, the others from /a/sql" in caplog.text, 10)
        finally:
            await router.close()

    run(main())  # (the fixture stops the engines started since too)


def test_router_resets_the_prefix_cache_of_every_engine(two_engines):
    """vLLM's /reset_prefix_cache through the router: every engine forgets its cached blocks, or (one running a
    request) the call says it was not done everywhere."""

    async def main():
        router = router_for(two_engines)
        await router.connect()
        try:
            for e in two_engines:
                e.prefix_cache.admit(list(range(64)))
            assert await router.reset_prefix_cache()
            assert all(not e.prefix_cache.blocks for e in two_engines)
            s = Stream()
            router.add("long", [1, 2, 3], p.SamplingParams(max_tokens=10_000, temperature=0), stream=s)
            await until(lambda: any(e.running for e in two_engines))
            assert not await router.reset_prefix_cache()
            router.abort(["long"])
        finally:
            await router.close()

    run(main())


def test_router_survives_a_dead_engine(two_engines):
    async def main():
        router = router_for(two_engines)
        await router.connect()
        params = p.SamplingParams(max_tokens=10_000, temperature=0)
        s0, s1 = Stream(), Stream()
        router.add("a", [1, 2], params, stream=s0)
        router.add("b", [1, 2], params, stream=s1)
        assert {s0.engine, s1.engine} == {0, 1}
        dead = s0.engine
        two_engines[dead].stop()  # its socket closes: the client sees the disconnect at once
        items = await drain(s0, {"a"})
        err = items["a"][-1]
        assert isinstance(err, p.Error) and err.status == 503 and "Engine unavailable" in err.message
        assert router.healthy
        health = router.engines_health()
        assert [e["status"] for e in health] == ["unavailable" if i == dead else "ok" for i in range(2)]
        # new calls go to the engine that lives
        s2 = router.add("c", [3, 4], p.SamplingParams(max_tokens=3, temperature=0))
        assert s2.engine == 1 - dead
        got = await drain(s2, {"c"})
        assert got["c"][-1].finish_reason == "length"
        stats = await router.stats()
        assert stats.num_kv_blocks > 0
        router.abort(["b"])
        two_engines[1 - dead].stop()
        await until(lambda: not router.healthy)
        with pytest.raises(EngineUnavailable):
            router.add("d", [1], params)
        await router.close()

    run(main())


def test_a_stalled_engine_gets_no_new_calls_while_another_answers(two_engines):
    """An engine unanswered for a sixth of the liveness timeout (hung: a stopped tensor-parallel worker) is
    "stalled" in ``/health``'s view, with the seconds; new calls go to the others, though it is no busier; its own
    requests wait on (they fail at the liveness timeout); its next answer makes it "ok" and a choice again. With
    every engine stalled, calls go to them as before (each may be in a long step)."""
    async def main():
        router = router_for(two_engines, liveness_timeout=6.0)  # (stalled after 1 s)
        await router.connect()
        try:
            params = p.SamplingParams(max_tokens=100_000, temperature=0)
            s0, s1 = router.add("a", [1, 2], params), router.add("b", [1, 2], params)
            assert {s0.engine, s1.engine} == {0, 1}
            hung = s1.engine
            two_engines[hung].mute = True
            await until(lambda: router.engines_health()[hung]["status"] == "stalled")
            health = router.engines_health()
            assert health[1 - hung]["status"] == "ok" and 1.0 <= health[hung]["unanswered_s"] < 6.0
            assert router.healthy and not router.stalled and router.clients[hung].num_in_flight == 1
            assert [router.pick() for _ in range(4)] == [1 - hung] * 4
            two_engines[hung].mute = False
            await until(lambda: router.engines_health()[hung]["status"] == "ok")
            await until(lambda: hung in {router.pick() for _ in range(4)})  # (as loaded as the other: a choice)
            assert router.clients[hung].num_in_flight == 1  # "b" ran on throughout
            for e in two_engines:
                e.mute = True
            await until(lambda: router.stalled)
            assert router.pick() in (0, 1) and router.unanswered() > 1.0  # (no EngineUnavailable)
        finally:
            for e in two_engines:
                e.mute = False
            router.abort(["a", "b"])
            await router.close()

    run(main())


def test_an_engine_in_long_steps_is_not_taken_for_stalled(two_engines):
    """An engine answers between its steps: steps longer than a sixth of the liveness timeout (a long prompt's
    chunks on a slow CPU, each up to three times the one before) are not a stall while each is under four times the
    longest one before it within the timeout (review W: two 8k-token prompts on this CPU made /health a 503 for 20
    s of 59, taking only the sixth)."""
    engine = two_engines[0]

    async def main():
        client = EngineClient(engine.address, "fe-steps", handshake_timeout=30, liveness_interval=0.1,
                              liveness_timeout=12.0)  # (stalled after 2 s at first)
        await client.connect()
        try:
            engine.step_delay = 0.8
            stream = client.add("long", [1, 2], p.SamplingParams(max_tokens=100_000))
            await stream.next_batch()
            seen = []
            for delay in (0.8, 2.4):  # three times longer: past the first 2 s, under four times 0.8
                engine.step_delay = delay
                for _ in range(int(2.2 * delay / 0.1)):
                    seen.append(client.stalled)
                    await asyncio.sleep(0.1)
            assert not any(seen) and 9.6 <= client.stall_after < 11.0
        finally:
            engine.step_delay = 0.01
            client.abort(["long"])
            await client.close()

    run(main())


def test_a_step_said_to_be_long_is_not_taken_for_stalled(tmp_path):
    """A first long step after quick ones (one huge prompt in one step on a slow CPU) tells the frontends nothing of
    its length: the engine says as it begins what it may take (Stats.step_s: its prompt tokens at the most seconds a
    prompt token took lately), where that is over a second, and its frontends take it for no stall before four
    times that. A step not said so is still judged by the floor: a hang in a usual small step is seen in seconds
    (review AC: a small step once said for being twice the last ones' size hid it)."""
    async def main(actors):
        engine = actors[0].engine

        async def one(client, rid, prompt_len, delay):  # (a request of one step: its prompt's)
            engine.step_delay = delay
            done = asyncio.ensure_future(drain(client.add(rid, list(range(1, prompt_len + 1)),
                                                  p.SamplingParams(max_tokens=1)), {rid}))
            seen = []
            while not done.done():
                seen.append(client.stalled)
                await asyncio.sleep(0.05)
            assert (await done)[rid][-1].finish_reason == "length"
            return seen

        async def connect(name):
            client = EngineClient(f"ipc://{tmp_path}/e0", name, handshake_timeout=30, liveness_interval=0.1,
                                  liveness_timeout=8.0)  # (stalled after 1.33 s at first)
            await client.connect()
            return client

        async def watch(client):
            seen = []
            for _ in range(60):
                seen.append(client.stalled)
                await asyncio.sleep(0.05)
            return seen

        a = await connect("fe-a")
        try:
            for rid in ("w1", "w2"):  # (said, nothing measured yet; quick anyway)
                assert not any(await one(a, rid, 20, 0.01))
            assert not any(await one(a, "rate", 10, 0.2))  # 0.02 s a token: 15 tokens may take 0.3 s, not said,
            assert any(await one(a, "small", 15, 2.5))  # so judged by the 1.33 s floor: a hang there is seen
            b = await connect("fe-b")  # (no step of its own seen yet: the floor)
            try:
                assert b.stall_after == a._stall_floor
                seen_a, seen_b = await asyncio.gather(one(a, "big", 41, 2.5), watch(b))
                assert not any(seen_b) and not any(seen_a)  # 41 tokens at 2.5/15 s: said, both frontends heard
                assert b.stall_after == 8.0  # (four times its 2.5 s, at most the timeout, for the next ones)
            finally:
                await b.close()
        finally:
            engine.step_delay = 0.01
            await a.close()

    with actors_of(tmp_path, (0.0,), step_delay=0.01) as (actors, _):
        run(main(actors))


def _against_restarts(tmp_path, scenario) -> None:
    """``scenario(engines, client)``: a client connected to a fake engine, the engines it restarts (``_restart``)
    stopped after."""
    engines = [FakeEngine(f"ipc://{tmp_path}/e.sock")]
    engines[0].start()

    async def main():
        client = EngineClient(engines[0].address, "fe-test", handshake_timeout=30, liveness_interval=0.1)
        await client.connect()
        try:
            await scenario(engines, client)
        finally:
            await client.close()

    try:
        run(main())
    finally:
        engines[-1].stop()


async def _restart(engines: list[FakeEngine], client: EngineClient, **attrs) -> None:
    """The last of ``engines`` stopped (``client`` sees it go) and a new one started at its address with ``attrs``."""
    engines[-1].stop()
    await until(lambda: not client.healthy)
    engines.append(FakeEngine(engines[-1].address))
    for k, v in attrs.items():
        setattr(engines[-1], k, v)
    engines[-1].start()


def test_an_engine_that_comes_back_unlike_it_was_is_not_served(tmp_path, caplog):
    """A (remote) engine restarted with another model, vocabulary or context stays unavailable, said so: the
    frontend's tokenizer and limits are those of the engine it started with (it took it back, and served it).
    Its health waits for its READY (its answers to pings made it healthy, and a HELLO lost as the connection was
    made was never sent again: the READY never came, and the check never ran)."""
    async def scenario(engines, client):
        for vocab, served in ((VOCAB + 1, False), (VOCAB, True)):
            await _restart(engines, client, vocab_size=vocab, lost_hellos=1)  # (pings answered, no READY yet)
            if served:
                await until(lambda: client.healthy, 10)
                s = client.add("a", [1, 2], p.SamplingParams(max_tokens=2, temperature=0))
                assert (await drain(s, {"a"}))["a"][-1].finish_reason == "length"
            else:
                await until(lambda: "came back serving" in caplog.text, 10)
                await asyncio.sleep(0.5)
                assert not client.healthy and client.ready.vocab_size == VOCAB
                with pytest.raises(EngineUnavailable):
                    client.add("a", [1, 2], p.SamplingParams(max_tokens=2))

    _against_restarts(tmp_path, scenario)
    assert f"vocabulary {VOCAB + 1}, context" in caplog.text


def test_an_engine_that_refuses_a_reconnected_frontend_is_asked_no_more(tmp_path, caplog):
    """An engine that answers HELLO with an error (another protocol version) is not greeted again and again (a
    HELLO a second, and two ERROR lines each, for as long as it ran), and says why once."""
    async def scenario(engines, client):
        await _restart(engines, client, hello_refusal="protocol version mismatch: frontend 18, engine 999")
        await until(lambda: "refused this frontend" in caplog.text, 10)
        await asyncio.sleep(2.5)
        assert not client.healthy and engines[1].hellos == 1
        assert caplog.text.count("refused this frontend: protocol version mismatch") == 1

    _against_restarts(tmp_path, scenario)


def test_ipv6_is_asked_of_zmq_for_ipv6_addresses_alone():
    """With ``zmq.IPV6`` a host name resolves to IPv6 alone: one with both families (localhost, often) took the
    one nothing listened on (review Q)."""
    assert wants_ipv6("tcp://[::1]:5555") and wants_ipv6("tcp://*:5555")
    assert not any(map(wants_ipv6, ["tcp://localhost:5555", "tcp://127.0.0.1:5555", "tcp://0.0.0.0:5555",
                                    "ipc:///tmp/e.sock"]))


def test_a_stopping_engine_finishes_its_requests_and_gets_no_new_ones(tmp_path, monkeypatch):
    """``tokenmill engine --shutdown-timeout``: stopped, an engine runs its requests to their end (they failed at once)
    and takes no new ones; its frontends send theirs to the other engines, and say it is draining (``/health``, and
    ``/metrics``' ``engine_draining``). It stops once nothing has run for a moment, not between a call's parts."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)

    def drains() -> dict[str, float]:
        text = metrics.render().decode()
        return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
                if f.name == "tokenmill:engine_draining" for s in f.samples}

    async def main():
        router = router_for([SimpleNamespace(address=f"ipc://{tmp_path}/e{i}") for i in range(2)])
        await router.connect()
        for i, c in enumerate(router.clients):
            metrics.watch(c, str(i))
        draining = router.clients[0]
        s = draining.add("a", [1, 2], p.SamplingParams(max_tokens=50, temperature=0))
        await asyncio.sleep(0.1)
        assert drains() == {"0": 0, "1": 0}
        actors[0].stop()  # (SIGTERM's handler)
        await until(lambda: draining.draining)
        assert [e["status"] for e in router.engines_health()] == ["draining", "ok"] and router.accepting
        assert drains() == {"0": 1, "1": 0}  # (at once, not at its next STATS: review V)
        assert router.add("b", [3], p.SamplingParams(max_tokens=2)).engine == 1
        with pytest.raises(EngineUnavailable, match="shutting down"):
            draining.add("c", [3], p.SamplingParams(max_tokens=2))
        got = await drain(s, {"a"})
        assert not isinstance(got["a"][-1], p.Error), got["a"][-1]
        assert got["a"][-1].finish_reason == "length" and sum(len(d.token_ids) for d in got["a"]) == 50
        # a call's next part (a beam search's next round) right after: still taken (the engine stopped between them)
        s = draining.add("d", [1, 2], p.SamplingParams(max_tokens=5, temperature=0), admitted=True)
        assert (await drain(s, {"d"}))["d"][-1].finish_reason == "length"
        await until(lambda: not draining.healthy)  # (then it stopped)
        assert drains() == {"0": 0, "1": 0}
        await router.close()

    metrics = Metrics(MODEL, 512)
    with actors_of(tmp_path, (30.0, 0.0), step_delay=0.02) as (actors, threads):
        run(main())
        threads[0].join(10)
        assert not threads[0].is_alive()


def test_an_idle_engine_without_frontends_ends_its_drain_on_its_own(tmp_path):
    """SIGTERM to a ``--shutdown-timeout`` engine that nothing talks to: it ends after its quiet, not at a frame
    that never comes (before: it waited for a second signal, review V)."""
    with actors_of(tmp_path, (30.0,)) as (actors, threads):
        time.sleep(0.2)  # (waiting for frames)
        start = time.monotonic()
        actors[0].stop()  # (SIGTERM's handler)
        threads[0].join(5)
        assert not threads[0].is_alive() and time.monotonic() - start < 3


def test_a_frontend_hears_at_once_how_busy_the_engines_are(tmp_path):
    """Each frontend ranks the engines by their STATS and its own requests: another frontend's burst, begun and
    ended between two liveness pings (every 2 s), was seen there as the load it had been, so its next requests all
    went to the other engine (review N: bursts split 7/1 and 6/2 over two frontends). An engine now says its load
    whenever its requests come or go (``engine.server.LOAD_S``)."""
    async def main():
        a, b = (router_for([SimpleNamespace(address=f"ipc://{tmp_path}/e{i}") for i in range(2)], name=name,
                           liveness_interval=30.0) for name in ("fe-a", "fe-b"))
        await a.connect()
        await b.connect()
        # a's four: two long ones on engine 0, two short ones on engine 1
        streams = {f"a{i}": a.add(f"a{i}", [1, 2], p.SamplingParams(max_tokens=(40, 2)[i % 2], temperature=0))
                   for i in range(4)}
        assert [s.engine for s in streams.values()] == [0, 1, 0, 1]
        await asyncio.sleep(0.1)
        await b.stats()  # (what a liveness ping would bring: engine 0 busy with two)
        await until(lambda: b.load(0)[0] == 2)
        await asyncio.gather(*(drain(s, {rid}) for rid, s in streams.items()))
        await until(lambda: b.load(0)[0] == b.load(1)[0] == 0)  # (it was 2 until the next ping)
        assert sorted(b.add(f"b{i}", [3], p.SamplingParams(max_tokens=2)).engine for i in range(2)) == [0, 1]
        await a.close()
        await b.close()

    with actors_of(tmp_path, (0.0, 0.0), step_delay=0.01):
        run(main())


@contextlib.contextmanager
def actors_of(tmp_path, graces, **engine_kw):
    """Real engine actors (``run_engine`` in threads) over the actor tests' fake engine, at ipc://tmp_path/e<i>, one
    per ``--shutdown-timeout`` in ``graces``: (their actors, their threads)."""
    actors, threads = [], []
    try:
        for i, grace in enumerate(graces):
            ready = threading.Event()
            threads.append(threading.Thread(
                target=run_engine, daemon=True, args=(EngineConfig(), f"ipc://{tmp_path}/e{i}"),
                kwargs=dict(ready=ready.set, on_actor=actors.append, shutdown_grace=grace,
                            engine_factory=lambda c: ActorFakeEngine(c, **engine_kw))))
            threads[-1].start()
            assert ready.wait(10)
        yield actors, threads
    finally:
        for a in actors:
            a.stop()
        for t in threads:
            t.join(10)


def test_router_started_with_a_dead_engine_serves_on_the_others(two_engines):
    async def main():
        two_engines[0].stop()
        router = EngineRouter(
            [EngineClient(e.address, "fe-test", handshake_timeout=5) for e in two_engines], dead=[0])
        await router.connect()  # at once: engine 0 is not waited for
        assert [e["status"] for e in router.engines_health()] == ["unavailable", "ok"]
        s = router.add("r", [1, 2], p.SamplingParams(max_tokens=2, temperature=0))
        assert s.engine == 1 and (await drain(s, {"r"}))["r"][-1].finish_reason == "length"
        await router.close()

    run(main())


def test_combined_stats_sums_counts_and_weighs_kv_usage_by_blocks():
    s = combined_stats([p.Stats(1, 2, 0.5, 50, 100, 1, 0, 0.2), p.Stats(3, 4, 0.0, 300, 300, 2, 1, 0.4)])
    assert (s.num_waiting, s.num_running, s.num_free_blocks, s.num_kv_blocks) == (4, 6, 350, 400)
    assert s.kv_usage == pytest.approx(50 / 400)
    assert s.num_preemptions == 3 and s.prefix_cache_hit_rate == pytest.approx(0.3)


# ----------------------------------------------------------------------------- CURVE


class CurveEngine:
    """run_engine over tcp:// with an engine key, with a fake engine, in a thread."""

    def __init__(self, key: str | None = KEY, host: str = "127.0.0.1"):
        self.address = f"tcp://{host}:{free_port()}"
        self.actor = None
        self.error: BaseException | None = None
        ready = threading.Event()

        def target():
            try:
                run_engine(EngineConfig(), self.address, ready=ready.set, engine_factory=ActorFakeEngine,
                           on_actor=lambda a: setattr(self, "actor", a), engine_key=key)
            except BaseException as e:  # noqa: BLE001 - surfaced by the test
                self.error = e
                ready.set()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def close(self) -> None:
        if self.actor is not None:
            self.actor.stop()
        self.thread.join(10)


@pytest.fixture
def curve_engine():
    e = CurveEngine()
    assert e.error is None, e.error
    yield e
    e.close()


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("[::1]", marks=pytest.mark.skipif(
    not _has_ipv6(), reason="no IPv6 loopback here"))])
def test_tcp_engine_serves_a_client_with_the_key(host):
    """Over IPv6 too (ZMQ's sockets take it only when told: the engine failed to listen, "No such device")."""
    curve_engine = CurveEngine(host=host)
    assert curve_engine.error is None, curve_engine.error

    async def main():
        c = EngineClient(curve_engine.address, "fe-key", handshake_timeout=5, engine_key=KEY)
        ready = await c.connect()
        assert ready.model == "fake"
        s = c.add("r1", [3, 4], p.SamplingParams(max_tokens=3, temperature=0))
        got = await drain(s, {"r1"})
        assert [t for d in got["r1"] for t in d.token_ids] and got["r1"][-1].finish_reason == "length"
        await c.close()

    try:
        run(main())
    finally:
        curve_engine.close()


def intrude(s: zmq.Socket, *msgs) -> None:
    """Send without waiting: once the engine has turned the connection away, a DEALER has no peer and a send would
    wait forever (the test did, once, on a loaded machine)."""
    for msg in msgs:
        with contextlib.suppress(zmq.Again):
            s.send(p.encode(msg), zmq.NOBLOCK)


def test_tcp_engine_refuses_clients_without_the_right_key(curve_engine):
    async def refused(**kw):
        c = EngineClient(curve_engine.address, "fe-bad", handshake_timeout=1.0, **kw)
        with pytest.raises(EngineUnavailable, match="no READY"):
            await c.connect()
        await c.close()

    run(refused(engine_key="not-the-engine-key-at-all"))

    # no key at all: a plain DEALER (what an intruder would use) gets no answer to HELLO, nor to ADD
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(curve_engine.address)
        intrude(s, p.Hello("intruder"), p.Add("x", [1, 2], p.SamplingParams(max_tokens=2)))
        assert not s.poll(1000)
        s.close()

        # the engine's public key but a client key pair of its own: ZAP turns it away
        keys = p.curve_keys(KEY)
        public, secret = zmq.curve_keypair()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        s.setsockopt(zmq.CURVE_PUBLICKEY, public)
        s.setsockopt(zmq.CURVE_SECRETKEY, secret)
        s.connect(curve_engine.address)
        intrude(s, p.Hello("intruder"))
        assert not s.poll(1000)
    finally:
        ctx.destroy(linger=0)  # (never to the GC: see test_server_actor's signal test)
    assert curve_engine.actor.engine.added == []


def test_a_refused_handshake_leaves_no_socket_open(tmp_path):
    """An engine that answers HELLO with an error (another protocol version): connect() raises and closes its
    sockets, so its context terms (with one left open, term(), or a GC of the context, would wait for good)."""
    address = f"ipc://{tmp_path}/refusing.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)

    def refuse():
        if router.poll(10_000):
            frontend, _ = router.recv_multipart()
            router.send_multipart([frontend, p.encode(p.Error(None, 400, "invalid_request_error", "protocol 0"))])

    threading.Thread(target=refuse, daemon=True).start()
    client = EngineClient(address, "fe-refused", handshake_timeout=10)
    try:
        with pytest.raises(EngineUnavailable, match="refused the handshake"):
            run(client.connect())
        term = threading.Thread(target=client._ctx.term, daemon=True)
        term.start()
        term.join(5)
        assert not term.is_alive(), "connect() left a socket open: its context cannot term"
    finally:
        ctx.destroy(linger=0)


def test_a_frontend_that_cannot_start_closes_its_engine_client(tmp_path, smollm_tokenizer_dir, monkeypatch):
    """A frontend whose start-up fails after it connected to its engine (here its port is taken) closes its
    engine client as it fails, as it does when it stops: its context terms."""
    import gc
    import socket

    from frontends import server

    engine = FakeEngine(f"ipc://{tmp_path}/engine.sock")
    engine.start()
    clients = []
    monkeypatch.setattr(server, "engine_client", lambda args, make=server.engine_client: clients.append(make(args))
                        or clients[-1])
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    args = server.FrontendArgs(engine.address, smollm_tokenizer_dir, MODEL, "127.0.0.1", taken.getsockname()[1],
                               frontend_id="fe-taken", handshake_timeout=30)
    try:
        with pytest.raises(OSError):
            run(server.serve(args))
        (client,) = clients
        term = threading.Thread(target=client._ctx.term, daemon=True)
        term.start()
        term.join(5)
        assert not term.is_alive(), "serve() left its engine client open: its context cannot term"
    finally:
        gc.unfreeze()  # (serve() froze this process's objects)
        taken.close()
        for client in clients:
            client._ctx.destroy(linger=0)
        engine.stop()


def test_tcp_engine_needs_a_key_on_both_sides():
    e = CurveEngine(key=None)
    e.close()
    assert isinstance(e.error, ValueError) and "engine key" in str(e.error)
    with pytest.raises(ValueError, match="engine key"):
        EngineClient("tcp://127.0.0.1:1", "fe")
    with pytest.raises(ValueError, match="at least 16"):
        p.curve_keys("short")


def test_serve_flags_for_data_parallel_and_remote_engines():
    from engine.cli import build_parser, engine_key, serve_options

    def opts(*argv, env=None):
        return serve_options(build_parser().parse_args(["serve", *argv]))

    o = opts("-dp", "2")
    assert o.data_parallel_size == 2 and o.engine_addresses == []
    o = opts("--engine", "tcp://a:1", "--engine", "tcp://b:2", "--engine-key", KEY)
    assert o.engine_addresses == ["tcp://a:1", "tcp://b:2"] and o.engine_key == KEY
    with pytest.raises(ValueError, match="--data-parallel-size"):
        opts("-dp", "2", "--engine", "tcp://a:1", "--engine-key", KEY)
    with pytest.raises(ValueError, match="at least 1"):
        opts("-dp", "0")
    for bad in ("a:1", "tcp://127.0.0.1:99999", "tcp://127.0.0.1", "tcp://:5555", "tcp://h:0", "ipc://",
                "tcp://*:5555", "tcp://[]:5555", "tcp://::1:5555"):
        with pytest.raises(ValueError, match=r"tcp://HOST:PORT \(a port of 1-65535\)"):  # (ZMQ took them, or failed)
            opts("--engine", bad, "--engine-key", KEY)
    with pytest.raises(ValueError, match="given twice"):  # (its start waited out --startup-timeout)
        opts("--engine", "tcp://a:1", "--engine", "tcp://a:1", "--engine-key", KEY)
    for one, other in (("tcp://Host-A:5555", "tcp://host-a:05555"), ("tcp://[::1]:1", "tcp://[0:0::1]:1"),
                       ("tcp://[FE80::1]:1", "tcp://[fe80:0::1]:1"), ("ipc:///tmp/e", "ipc:///tmp/x/../e"),
                       ("tcp://127.0.0.1:1", "tcp://[::ffff:127.0.0.1]:1"), ("tcp://127.0.0.1:1", "tcp://127.1:1"),
                       ("tcp://10.0.0.1:1", "tcp://10.0.1:1"),
                       ("tcp://[fe80::1%eth0]:1", "tcp://[FE80::1%eth0]:1")):
        with pytest.raises(ValueError, match=rf"--engine {re.escape(other)} is given twice \(as {re.escape(one)}\)"):
            opts("--engine", one, "--engine", other, "--engine-key", KEY)
    assert len(opts("--engine", "tcp://a:1", "--engine", "tcp://a:2", "--engine", "tcp://10.0.0.1:1",
                    "--engine", "tcp://10.0.0.10:1", "--engine", "ipc://@x", "--engine", "ipc://x",
                    "--engine", "ipc://@a/../x", "--engine", "tcp://[fe80::1%eth0]:1", "--engine",
                    "tcp://[fe80::1%ETH0]:1", "--engine", "tcp://cafe:1", "--engine", "tcp://CAFE.example:1",
                    "--engine-key", KEY).engine_addresses) == 11
    assert opts("--engine", "tcp://[::1]:5555", "--engine", "ipc:///tmp/e", "--engine-key", KEY).engine_addresses
    assert engine_key(None, {"TOKENMILL_ENGINE_KEY": KEY}) == KEY
    assert engine_key("flag-wins-0123456789", {"TOKENMILL_ENGINE_KEY": KEY}) == "flag-wins-0123456789"
    with pytest.raises(ValueError, match="blank"):
        engine_key(" ", {})
