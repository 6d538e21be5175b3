"""``frontends.response_store``: Responses kept in one SQLite file, read back as the conversation they end,
per owner, the least recently used evicted past the bound; two stores on one file see each other's (the
frontends of a server)."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from frontends.response_store import BrokenChain, DuplicateItem, ResponseStore


def response(rid: str, previous: str | None = None, text: str = "x") -> dict:
    return {"id": rid, "object": "response", "previous_response_id": previous, "store": True,
            "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": text}]}]}


def said(rid: str, text: str) -> list[dict]:
    return [{"id": f"in_{rid}", "type": "message", "role": "user", "content": text}]


def test_a_conversation_is_its_responses_turns_in_order(tmp_path):
    async def run():
        a, b = ResponseStore(str(tmp_path / "r.db"), 1 << 20), ResponseStore(str(tmp_path / "r.db"), 1 << 20)
        await a.put(response("r1", text="A1"), said("r1", "Q1"), "k")
        await b.put(response("r2", "r1", text="A2"), said("r2", "Q2"), "k")  # (another frontend's store)
        items, first = await a.history("r2", "k")
        assert [(i["role"], i["content"] if i["role"] == "user" else i["content"][0]["text"]) for i in items] == [
            ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")]
        assert first == "r1"
        assert await b.get("r1", "k") == response("r1", text="A1")
        assert await b.input_items("r2", "k") == said("r2", "Q2")
        # another owner sees nothing, deletes nothing
        assert await a.get("r1", "other") is None and await a.history("r2", "other") is None
        assert not await a.delete("r1", "other")
        assert await a.history("nope", "k") is None
        assert await b.delete("r1", "k") and not await b.delete("r1", "k")
        with pytest.raises(BrokenChain, match="'r1' it continues is no longer stored"):
            await a.history("r2", "k")
        await a.close()
        await b.close()

    asyncio.run(run())


def test_past_its_bound_the_least_recently_used_go_first(tmp_path):
    """Continuing a conversation uses each of its Responses: the oldest turns of a live conversation stay, while a
    newer Response nobody continued goes. One thing past a sixteenth of the bound is not kept at all."""
    async def run():
        one = len(orjson.dumps(response("r00"))) + len(orjson.dumps(said("r00", "q")))
        store = ResponseStore(str(tmp_path / "r.db"), 32 * one + 16)  # (room for 32: r02 takes a little more)
        await store.put(response("r00"), said("r00", "q"), "k")
        await store.put(response("r01"), said("r01", "q"), "k")
        await store.put(response("r02", "r00"), said("r02", "q"), "k")
        for k in range(3, 32):
            await store.put(response(f"r{k:02}"), said(f"r{k:02}", "q"), "k")
        await store.history("r02", "k")  # r00 and r02 used now: r01 is the least recently used
        await store.put(response("r32"), said("r32", "q"), "k")
        assert [await store.get(r, "k") is not None for r in ("r00", "r01", "r02", "r32")] == [True, False, True, True]
        big = {**response("r33"), "output": [{"type": "message", "text": "x" * 2 * one}]}
        await store.put(big, said("r33", "q"), "k")  # (review: one past the bound evicted every other)
        assert await store.get("r33", "k") is None and await store.get("r03", "k") is not None
        await store.close()

    asyncio.run(run())


def test_conversations_count_against_the_bound_with_the_responses(tmp_path):
    """A conversation's items are its size; the least recently used of Responses and conversations goes first, a
    conversation with all its items; reading or growing a conversation uses it; one conversation keeps its newest
    items within a sixteenth of the bound."""
    async def run():
        item = said("i", "q" * 500)[0]
        store = ResponseStore(str(tmp_path / "r.db"), 16 * 1200)
        for k in range(18):  # (2 items of ~560 bytes each: the 18th is past the bound)
            await store.create_conversation({"id": f"c{k}", "created_at": 0, "metadata": {}}, [], "k")
            assert await store.add_items(f"c{k}", "k", [{**item, "id": f"c{k}-1"}, {**item, "id": f"c{k}-2"}])
            await store.items("c0", "k")  # (c0 used last, always)
        assert await store.conversation("c1", "k") is None and await store.conversation("c0", "k") is not None
        assert await store._call(lambda: store._conn().execute(
            "SELECT COUNT(*) FROM items WHERE conversation = 'c1'").fetchone()[0]) == 0
        assert not await store.add_items("c1", "k", [item])
        # one conversation that grows keeps its newest items, within a sixteenth of the bound
        for k in range(3, 8):
            assert await store.add_items("c0", "k", [{**item, "id": f"c0-{k}"}])
        assert [i["id"] for i in await store.items("c0", "k")] == ["c0-6", "c0-7"]
        # its items, deleted one by one, and its metadata
        assert (await store.delete_item("c0", "k", "c0-6"))["id"] == "c0"
        with pytest.raises(KeyError):
            await store.delete_item("c0", "k", "c0-6")
        assert await store.delete_item("c1", "k", "c1-1") is None
        assert await store.update_conversation("c0", "k", {"a": "b"}) == {
            "id": "c0", "object": "conversation", "created_at": 0, "metadata": {"a": "b"}}
        assert await store.update_conversation("c0", "other", {}) is None
        # a Response that went on with a conversation adds its input and output to it, stored itself or not
        await store.put({**response("r2", text="A"), "store": False, "conversation": {"id": "c0"}}, said("r2", "Q"), "k")
        assert [i["id"] for i in await store.items("c0", "k")] == ["c0-7", "in_r2", "msg_r2"]
        assert await store.get("r2", "k") is None
        page, more = await store.items_page("c0", "k", 2, True, None)
        assert [i["id"] for i in page] == ["msg_r2", "in_r2"] and more
        page, more = await store.items_page("c0", "k", 2, True, "in_r2")
        assert [i["id"] for i in page] == ["c0-7"] and not more
        with pytest.raises(KeyError):
            await store.items_page("c0", "k", 2, False, "nope")
        # what each key holds, kept by the triggers, is what its things take
        held = await store._call(lambda: store._conn().execute(
            "SELECT (SELECT size FROM owners WHERE owner = 'k'), (SELECT SUM(size) FROM conversations) + "
            "(SELECT IFNULL(SUM(size), 0) FROM responses)").fetchone())
        assert held[0] == held[1]
        await store.close()
        await store.close()  # (twice: review)

    asyncio.run(run())


def test_a_key_growing_a_conversation_evicts_nobody_else(tmp_path):
    """One key adding item after item to one conversation: another key's things stay (review: they were all
    evicted, and the conversation itself went with the turn that grew it)."""
    async def run():
        store = ResponseStore(str(tmp_path / "r.db"), 100_000)
        for k in range(5):
            await store.put(response(f"b{k}"), said(f"b{k}", "q"), "B")
        await store.create_conversation({"id": "c", "created_at": 0, "metadata": {}}, [], "A")
        for k in range(30):
            assert await store.add_items("c", "A", [{**said("i", "x" * 5000)[0], "id": f"i{k}"}])
            await store.put({**response(f"a{k}"), "conversation": {"id": "c"}}, said(f"a{k}", "q"), "A")
        assert all([await store.get(f"b{k}", "B") is not None for k in range(5)])
        assert (await store.items("c", "A"))[-1]["id"] == "msg_a29"
        await store.close()

    asyncio.run(run())


def test_the_key_that_holds_the_most_gives_back_first(tmp_path):
    """A key that floods the store evicts its own least recently used things, not another key's (review: one key's
    flood evicted every key's conversations)."""
    async def run():
        store = ResponseStore(str(tmp_path / "r.db"), 20_000)
        for k in range(4):
            await store.put(response(f"b{k}", text="b" * 1000), said(f"b{k}", "q"), "B")
        for k in range(40):  # (newer than all of B's)
            await store.put(response(f"a{k}", text="a" * 1000), said(f"a{k}", "q"), "A")
        assert all([await store.get(f"b{k}", "B") is not None for k in range(4)])
        kept = [k for k in range(40) if await store.get(f"a{k}", "A") is not None]
        assert kept == list(range(40 - len(kept), 40)) and 8 < len(kept) < 16  # A's latest, within the bound
        await store.close()

    asyncio.run(run())


def test_frontends_writing_at_once_wait_their_turn(tmp_path):
    """Two stores on one file (two frontends) continuing and growing chains at once: every call answered (review:
    a continuation's read-then-mark failed with "database is locked" beside another frontend's write)."""
    async def run():
        stores = [ResponseStore(str(tmp_path / "r.db"), 1 << 30) for _ in range(2)]
        await stores[0].put(response("r0"), said("r0", "q"), "k")
        rng, parent = random.Random(0), {0: None}

        async def turn(k: int, start: int) -> None:  # (what it reads and continues: written in batches before)
            store = stores[k % 2]
            assert await store.history(f"r{rng.randrange(start + 1)}", "k") is not None
            parent[k + 1] = rng.randrange(start + 1)
            await store.put(response(f"r{k + 1}", f"r{parent[k + 1]}"), said(f"r{k + 1}", "q"), "k")

        for start in range(0, 400, 40):
            await asyncio.gather(*(turn(k, start) for k in range(start, start + 40)))
        chain, at = [], 400
        while at is not None:
            chain.append(f"r{at}")
            at = parent[at]
        items, first = await stores[1].history("r400", "k")
        assert first == "r0" and [i["id"] for i in items[::2]] == [f"in_{r}" for r in reversed(chain)]
        for store in stores:
            await store.close()

    asyncio.run(run())


def test_a_call_cut_short_is_not_read_again(tmp_path):
    """The next turn reads an earlier output without a function_call cut short (its arguments may be no JSON; review:
    every later turn of that chain was a 400)."""
    async def run():
        store = ResponseStore(str(tmp_path / "r.db"), 1 << 20)
        cut = {**response("r1"), "output": [
            {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": []},
            {"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f", "arguments": '{"ci',
             "status": "incomplete"}]}
        await store.put(cut, said("r1", "q"), "k")
        items, _ = await store.history("r1", "k")
        assert [i["id"] for i in items] == ["in_r1", "msg_1"]
        assert (await store.get("r1", "k"))["output"] == cut["output"]  # (kept as it was answered)
        await store.close()

    asyncio.run(run())


def test_what_a_conversation_is_given_stays_whole(tmp_path):
    """A turn whose item's id came into the conversation meanwhile gets a new one (review: paging over the two
    never ended); another key learns nothing of a conversation's ids (review: its duplicate 400 said which it
    holds); the cap drops a dropped call's results too (review: a result was left at the head without its call)."""
    async def run():
        store = ResponseStore(str(tmp_path / "r.db"), 16 * 2000)  # (a conversation keeps 2,000 bytes)
        await store.create_conversation({"id": "c", "created_at": 0, "metadata": {}}, [said("a", "q")[0]], "k")
        with pytest.raises(DuplicateItem):
            await store.add_items("c", "k", [said("a", "again")[0]])
        assert not await store.add_items("c", "other", [said("a", "again")[0]])  # (a 404, as for any other id)
        await store.put({**response("r1"), "conversation": {"id": "c"}}, said("a", "raced"), "k")
        ids = [i["id"] for i in await store.items("c", "k")]
        assert len(set(ids)) == 3 and ids[0] == "in_a" and ids[1].startswith("in_a_") and ids[2] == "msg_r1"
        call = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
        result = {"id": "fco_1", "type": "function_call_output", "call_id": "call_1", "output": "x" * 100}
        await store.add_items("c", "k", [call, said("u", "between")[0], result])
        between, big = said("u", "between")[0], said("big", "")[0]
        room = 2000 - 2 - sum(len(orjson.dumps(i)) for i in (between, result, big))  # (2: the metadata's "{}")
        big["content"] = "y" * (room - len(orjson.dumps(call)) + 8)  # (past 2,000 by the call: it goes, its result too)
        await store.add_items("c", "k", [big])
        kinds = [(i["id"], i.get("type")) for i in await store.items("c", "k")]
        assert ("fco_1", "function_call_output") not in kinds and kinds[-1] == ("in_big", "message")
        await store.close()

    asyncio.run(run())


def background(rid: str, status: str = "queued", text: str = "") -> dict:
    return {**response(rid, text=text), "background": True, "status": status, **({"output": []} if not text else {})}


def held(store: ResponseStore) -> tuple[int, int]:
    """What the owners' totals say the store holds, and what its rows hold."""
    from frontends.response_store import connect

    db = connect(store.path)
    try:
        return (db.execute("SELECT SUM(size) FROM owners").fetchone()[0],
                db.execute("SELECT (SELECT COALESCE(SUM(size), 0) FROM responses) + "
                           "(SELECT COALESCE(SUM(size), 0) FROM conversations)").fetchone()[0])
    finally:
        db.close()


def test_a_background_response_runs_ends_and_is_cancelled(tmp_path):
    """A background Response is kept as it begins, then as it goes (its events, its status), then whole when it ends,
    over its running state; a cancel takes it from its runner, whose later writes change nothing; its events and its
    running state count in its size."""
    from frontends.response_store import NotBackground, StillRunning

    async def run():
        a, b = ResponseStore(str(tmp_path / "r.db"), 1 << 20), ResponseStore(str(tmp_path / "r.db"), 1 << 20)
        await a.start(background("r1"), said("r1", "Q1"), "k", "fe-a", events=[])
        assert (await b.get("r1", "k"))["status"] == "queued" and await b.get("r1", "other") is None
        assert await a.progress("r1", "fe-a", [(0, b"e0"), (1, b"e1")], background("r1", "in_progress")) == (True, True)
        assert await b.events("r1", "k", -1) == ([(0, b"e0"), (1, b"e1")], background("r1", "in_progress"), True)
        assert (await b.events("r1", "k", 0, limit=1))[0] == [(1, b"e1")]
        with pytest.raises(StillRunning):  # (nothing to continue yet)
            await b.history("r1", "k")
        assert await a.progress("r1", "fe-b", [], None) == (False, False)  # (another runner's)
        assert held(a)[0] == held(a)[1]
        assert await a.finish(background("r1", "completed", "A1"), said("r1", "Q1"), "k", [(2, b"e2")])
        assert await b.get("r1", "k") == background("r1", "completed", "A1")
        assert await b.events("r1", "k", 1) == ([(2, b"e2")], background("r1", "completed", "A1"), True)
        assert (await b.history("r1", "k"))[0][-1]["content"][0]["text"] == "A1"
        assert (await b.cancel("r1", "k"))["status"] == "completed"  # (ended: as it is)
        # cancelled on another frontend: its runner learns it at its next write or look, and writes nothing more
        await a.start(background("r2"), said("r2", "Q2"), "k", "fe-a", events=None)
        assert await a.heartbeat("fe-a", ["r2"]) == {"r2"}
        assert (await b.cancel("r2", "k"))["status"] == "cancelled"
        assert (await b.cancel("r2", "k"))["status"] == "cancelled"  # (twice: as it is)
        assert await a.heartbeat("fe-a", ["r2"]) == set()
        assert not (await a.progress("r2", "fe-a", [(0, b"e0")], background("r2", "in_progress")))[0]
        assert not await a.finish(background("r2", "completed", "A2"), said("r2", "Q2"), "k", [])
        assert (await b.get("r2", "k"))["status"] == "cancelled"
        assert (await b.events("r2", "k", -1))[::2] == ([], False)  # (not created streamed)
        await a.put({**response("r3"), "status": "completed"}, said("r3", "Q3"), "k")
        with pytest.raises(NotBackground):
            await b.cancel("r3", "k")
        assert await b.cancel("nope", "k") is None
        # deleted while it runs: its running state goes with it
        await a.start(background("r4"), said("r4", "Q4"), "k", "fe-a", events=[])
        assert await b.delete("r4", "k") and await a.heartbeat("fe-a", ["r4"]) == set()
        assert held(a)[0] == held(a)[1]
        await a.close()
        await b.close()

    asyncio.run(run())


def test_a_run_whose_frontend_stopped_has_failed(tmp_path, monkeypatch):
    """A running background Response whose frontend has not said so for STALE seconds (it died) reads as failed, as
    do those of a frontend that stops (``abandon``)."""
    from frontends import response_store

    async def run():
        store = ResponseStore(str(tmp_path / "r.db"), 1 << 20)
        await store.start(background("r1"), said("r1", "Q"), "k", "fe-a", events=None)
        await store.start(background("r2"), said("r2", "Q"), "k", "fe-b", events=None)
        await store.start(background("r3"), said("r3", "Q"), "k", "fe-c", events=None)
        assert (await store.get("r1", "k"))["status"] == "queued"
        await store.abandon("fe-b")
        got = await store.get("r2", "k")
        assert got["status"] == "failed" and got["error"]["message"] == "the server stopped before it ended"
        monkeypatch.setattr(response_store, "STALE", -1.0)  # (every frontend has been quiet too long)
        got = await store.get("r1", "k")
        assert got["status"] == "failed" and got["error"]["code"] == "server_error"
        assert not (await store.progress("r1", "fe-a", [], None))[0]  # (its runner, back: no longer its to run)
        assert (await store.history("r3", "k"))[0] == said("r3", "Q")  # (failed: continued as it stands)
        assert held(store)[0] == held(store)[1]
        await store.close()

    asyncio.run(run())


def test_a_background_response_past_its_share_keeps_no_events_and_is_never_evicted_while_it_runs(tmp_path):
    """Events past a sixteenth of the bound are no longer kept (none of them); a running Response is not evicted,
    however old, and one that ends too large to keep is kept failed, without its output."""
    async def run():
        store = ResponseStore(str(tmp_path / "r.db"), 16 * 4096)
        await store.start(background("r0"), said("r0", "Q"), "k", "fe-a", events=[])
        assert await store.progress("r0", "fe-a", [(0, b"e" * 1000)], background("r0", "in_progress")) == (True, True)
        # (past 4096 with its Response: still its to run, its events no longer kept)
        assert await store.progress("r0", "fe-a", [(1, b"e" * 4000)], None) == (True, False)
        assert (await store.events("r0", "k", -1))[::2] == ([], False)
        assert await store.progress("r0", "fe-a", [(2, b"e")], None) == (True, False)
        for k in range(1, 40):  # (the bound many times over, in Responses that use it later)
            await store.put({**response(f"r{k:02}", text="y" * 2000), "status": "completed"}, said("x", "q"), "k")
        assert (await store.get("r0", "k"))["status"] == "in_progress"
        assert await store.get("r01", "k") is None
        assert await store.finish(background("r0", "completed", "z" * 5000), said("r0", "Q"), "k", [(3, b"e")])
        got = await store.get("r0", "k")
        assert got["status"] == "failed" and got["output"] == [] and "took more" in got["error"]["message"]
        assert (await store.events("r0", "k", -1))[::2] == ([], False)
        assert held(store)[0] == held(store)[1] <= 16 * 4096
        await store.close()

    asyncio.run(run())


def test_runs_evict_nobody_and_only_live_runs_are_spared(tmp_path):
    """A key's running background Responses are neither counted against the bound nor evicted, so they evict nothing
    of another key's; together they may take a quarter of the bound (past it none starts, and a run's events are no
    longer kept). A run whose frontend no longer says so (it died, or let it go) is stale: it reads as failed, it is
    counted, and evicted, as any other, its key's first (review: a key's runs took the store many times past its
    bound, and cancelling them left it so). A run that takes more than one thing may is not started."""
    from frontends.response_store import RunsFull, connect

    async def run():
        one = len(orjson.dumps(response("o00", text="y" * 500))) + len(orjson.dumps(said("o00", "q")))
        store = ResponseStore(str(tmp_path / "r.db"), 32 * one)  # (a quarter: 8 runs of one)
        for k in range(10):
            await store.put({**response(f"o{k:02}", text="y" * 500), "status": "completed"}, said(f"o{k:02}", "q"),
                            "other")
        started = 0
        with pytest.raises(RunsFull):
            for started in range(40):  # (past its quarter: refused)
                await store.start({**background(f"r{started:02}"), "pad": "p" * 500}, said("x", "q"), "k", "fe-a", [])
        assert 6 <= started <= 8 and await store.get(f"r{started:02}", "k") is None
        assert all([await store.get(f"o{k:02}", "other") for k in range(10)])  # (nothing of other's evicted)
        assert await store.heartbeat("fe-a", ["r00", "r01"]) == {"r00", "r01"}
        # a run's events past its key's quarter are no longer kept
        assert await store.progress("r00", "fe-a", [(0, b"e" * (8 * one))], None) == (True, False)
        db = connect(store.path)
        db.execute("UPDATE background SET alive = alive - 1000 WHERE id NOT IN ('r00', 'r01')")  # (let go long ago)
        db.close()
        assert (await store.get("r05", "k"))["status"] == "failed"  # (read: failed, and counted again)
        await store.fail("r01", "fe-b", "not its")  # (another runner's word changes nothing)
        assert (await store.get("r01", "k"))["status"] == "queued"
        await store.fail("r01", "fe-a", "the engine could not be reached")
        assert (await store.get("r01", "k"))["error"]["message"] == "the engine could not be reached"
        for k in range(20):  # (k holds the most: its least recently used go first, the stale runs)
            await store.put({**response(f"k{k:02}", text="y" * 500), "status": "completed"}, said("x", "q"), "k")
        assert all([await store.get(f"o{k:02}", "other") for k in range(10)])
        assert await store.get("r02", "k") is None and (await store.get("r00", "k"))["status"] == "queued"
        assert (await store.cancel("r00", "k"))["status"] == "cancelled"
        assert not await store.start(background("big"), said("big", "q" * 16 * one), "k", "fe-a", None)
        assert await store.get("big", "k") is None
        assert held(store)[0] == held(store)[1] <= 32 * one
        await store.close()

    asyncio.run(run())


def test_one_turn_at_a_time_holds_a_conversation(tmp_path, monkeypatch):
    """A turn that reads a conversation's items takes its lock; another turn is refused (``Locked``) until the first
    adds its items, lets go, or its lease runs out (a frontend that died); a renewed lease holds on."""
    from frontends import response_store
    from frontends.response_store import Hold, Locked

    async def run():
        a, b = ResponseStore(str(tmp_path / "r.db"), 1 << 20), ResponseStore(str(tmp_path / "r.db"), 1 << 20)
        held_a, held_b = {}, {}
        await a.create_conversation({"id": "c1", "created_at": 0, "metadata": {}}, said("i0", "Q0"), "k")
        first = Hold(a, "c1", held_a)
        assert await a.items("c1", "k", first) == said("i0", "Q0")
        with pytest.raises(Locked):
            await b.items("c1", "k", Hold(b, "c1", held_b))
        assert await b.items("c1", "k") == said("i0", "Q0")  # (reading alone: no lock)
        await a.put({**response("r1"), "status": "completed", "conversation": {"id": "c1"}}, said("i1", "Q1"), "k",
                    first)  # (its items added: let go of)
        second = Hold(b, "c1", held_b)
        assert len(await b.items("c1", "k", second)) == 3
        second.release()
        await asyncio.sleep(0.05)  # (the release: a task)
        assert second.holder not in held_b
        third = Hold(a, "c1", held_a)
        await a.items("c1", "k", third)
        monkeypatch.setattr(response_store, "LEASE", -1.0)
        await a.renew([third.holder])  # (a lease that ran out: another turn takes it)
        await b.items("c1", "k", Hold(b, "c1", held_b))
        assert await a.delete_conversation("c1", "k")
        from frontends.response_store import connect

        db = connect(a.path)
        assert db.execute("SELECT COUNT(*) FROM locks").fetchone()[0] == 0  # (gone with its conversation)
        db.close()
        await a.close()
        await b.close()

    asyncio.run(run())


def test_a_file_made_before_the_conversation_locks_is_brought_up_to_date(tmp_path):
    """A store file whose ``background`` table has no ``holds`` column (made by a build before it) gets one as it is
    opened: background Responses start, and Responses are deleted, as in a new file (review: both were 503s)."""
    import sqlite3

    path = str(tmp_path / "r.db")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE background (id TEXT PRIMARY KEY, runner TEXT NOT NULL, alive REAL NOT NULL, "
               "events INTEGER NOT NULL)")
    db.close()

    async def run():
        store = ResponseStore(path, 1 << 20)
        await store.start(background("r1"), said("r1", "Q"), "k", "fe-a", None)
        await store.put({**response("r2"), "status": "completed"}, said("r2", "Q"), "k")
        assert await store.delete("r2", "k") and await store.delete("r1", "k")
        await store.close()

    asyncio.run(run())


def _open_at(path: str, barrier, errors) -> None:
    from frontends.response_store import connect
    barrier.wait()
    try:
        connect(path).close()
    except Exception as e:  # noqa: BLE001 (reported to the test)
        errors.put(repr(e))


def test_frontends_opening_a_new_file_together_all_open_it(tmp_path):
    """A server's frontends open the store as they start, at once: switching a new file to WAL answered "database is
    locked" at once to one of three in about 1 start in 10, and that frontend never started (a full suite's
    test_server_e2e failed so)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    for i in range(60):
        barrier, path = ctx.Barrier(3), str(tmp_path / f"{i}.sqlite")
        procs = [ctx.Process(target=_open_at, args=(path, barrier, errors)) for _ in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0]
    assert errors.empty(), errors.get()
