"""``frontends.response_store``: Responses kept in one SQLite file, read back as the conversation they end,
per owner, the least recently used evicted past the bound; two stores on one file see each other's (the
frontends of a server)."""

from __future__ import annotations

import asyncio

import pytest

from frontends.response_store import BrokenChain, ResponseStore


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
        a.close()
        b.close()

    asyncio.run(run())


def test_past_its_bound_the_least_recently_used_go_first(tmp_path):
    """Continuing a conversation uses each of its Responses: the oldest turns of a live conversation stay, while a
    newer Response nobody continued goes."""
    async def run():
        one = len(__import__("orjson").dumps(response("r0"))) + len(__import__("orjson").dumps(said("r0", "q")))
        store = ResponseStore(str(tmp_path / "r.db"), 3 * one)  # (room for three)
        await store.put(response("r0"), said("r0", "q"), "k")
        await store.put(response("r1"), said("r1", "q"), "k")
        await store.put(response("r2", "r0"), said("r2", "q"), "k")
        await store.history("r2", "k")  # r0 and r2 used now: r1 is the least recently used
        await store.put(response("r3"), said("r3", "q"), "k")
        assert [await store.get(r, "k") is not None for r in ("r0", "r1", "r2", "r3")] == [True, False, True, True]
        await store.put(response("r4"), said("r4", "q"), "k")  # then the conversation's (used together): one goes
        assert [await store.get(r, "k") is not None for r in ("r0", "r2")].count(True) == 1
        assert await store.get("r3", "k") is not None and await store.get("r4", "k") is not None
        big = ResponseStore(str(tmp_path / "r.db"), one // 2)  # a Response past the whole bound is still kept
        await big.put(response("r5"), said("r5", "q"), "k")
        assert await big.get("r5", "k") is not None and await big.get("r4", "k") is None
        store.close()
        big.close()

    asyncio.run(run())


def test_conversations_count_against_the_bound_with_the_responses(tmp_path):
    """A conversation's items are its size; the least recently used of Responses and conversations goes first, a
    conversation with all its items; reading or growing a conversation uses it."""
    async def run():
        item = said("i", "q" * 1000)[0]
        store = ResponseStore(str(tmp_path / "r.db"), 5000)
        for name in ("c1", "c2"):
            await store.create_conversation({"id": name, "created_at": 0, "metadata": {}}, [], "k")
            assert await store.add_items(name, "k", [{**item, "id": f"{name}-1"}, {**item, "id": f"{name}-2"}])
        await store.items("c1", "k")  # c1 used after c2
        await store.put(response("r1", text="t" * 1000), said("r1", "q"), "k")  # past 5000: c2 goes, whole
        assert await store.conversation("c2", "k") is None and await store.items("c2", "k") is None
        assert [i["id"] for i in await store.items("c1", "k")] == ["c1-1", "c1-2"]
        assert not await store.add_items("c2", "k", [item])
        assert await store.delete_item("c1", "k", "c1-1") and not await store.delete_item("c1", "k", "c1-1")
        assert await store.delete_item("c2", "k", "c2-1") is None
        assert await store.update_conversation("c1", "k", {"a": "b"}) == {
            "id": "c1", "object": "conversation", "created_at": 0, "metadata": {"a": "b"}}
        assert await store.update_conversation("c1", "other", {}) is None
        # a Response that went on with a conversation adds its input and output to it, stored itself or not
        await store.put({**response("r2", text="A"), "store": False, "conversation": {"id": "c1"}}, said("r2", "Q"), "k")
        assert [i["id"] for i in await store.items("c1", "k")] == ["c1-2", "in_r2", "msg_r2"]
        assert await store.get("r2", "k") is None
        store.close()

    asyncio.run(run())
