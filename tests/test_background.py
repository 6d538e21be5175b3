"""Background Responses (``frontends.background``) served: two real frontend processes over one fake engine
(which answers with the prompt's own tokens, one a step) and one store file, through the official ``openai``
client: created on one frontend, polled, cancelled and streamed again on the other."""

from __future__ import annotations

import time

import httpx
import openai
import orjson
import pytest

from tests.test_responses import OTHER_KEY, SHOWN_TEMPLATE, STOP, stored_stack
from tools.fake_engine import KEY, MODEL, free_port, start_frontend, stop_frontend

LONG = "a story about otters in space " * 8  # (its answer is itself again: max_output_tokens long)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm_tokenizer_dir):
    """(engine, [client of frontend A, of B, of A under another key], the store file, the ports): a token every
    10 ms."""
    with stored_stack(tmp_path_factory.mktemp("background"), smollm_tokenizer_dir, step_delay=0.01) as stack:
        yield stack


def polled(client, response_id: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_a_background_response_is_answered_queued_and_polled_to_its_end_on_either_frontend(runs):
    """Answered at once (``queued``), then ``in_progress``, then ended on the other frontend as the same request
    answered in the foreground is; continued (``previous_response_id``) once it has ended, not before."""
    _, (a, b, other), _, _ = runs
    kw = dict(model=MODEL, input="Q1 " + LONG, max_output_tokens=120)
    r = a.responses.create(background=True, **kw)
    assert r.background and r.status == "queued" and r.output == [] and r.store
    with pytest.raises(openai.BadRequestError) as e:  # (nothing to continue yet)
        b.responses.create(model=MODEL, input="Q2", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id" and "still in progress" in e.value.body["message"]
    seen = {r.status}
    while r.status in ("queued", "in_progress"):
        r = b.responses.retrieve(r.id)
        seen.add(r.status)
        time.sleep(0.02)
    assert "in_progress" in seen and r.status == "incomplete" and r.background
    fore = a.responses.create(store=False, **kw)
    assert r.output_text == fore.output_text and r.usage.output_tokens == fore.usage.output_tokens == 120
    assert a.responses.cancel(r.id).status == "incomplete"  # (ended: as it is)
    r2 = b.responses.create(model=MODEL, input="Q2", previous_response_id=r.id, extra_body=STOP)
    assert r2.output_text.startswith("user: Q1 a story") and r2.output_text.endswith("user: Q2\n")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)


def test_a_cancel_on_another_frontend_stops_the_run_in_the_engine(runs):
    """``responses.cancel`` on the frontend that does not run it: ``cancelled`` at once, the engine's request
    aborted at the running frontend's next look (a second), the Response left cancelled, and cancelling it again
    answers the same. A Response created in the foreground is no background one to cancel."""
    engine, (a, b, other), _, _ = runs
    r = a.responses.create(model=MODEL, input=LONG, background=True, max_output_tokens=400)
    assert polled(b, r.id, timeout=0.3).status == "in_progress"
    with pytest.raises(openai.NotFoundError):  # (another key's)
        other.responses.cancel(r.id)
    assert b.responses.cancel(r.id).status == "cancelled"
    deadline = time.monotonic() + 5
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.running  # (aborted, not run to its 400 tokens)
    assert b.responses.retrieve(r.id).status == a.responses.cancel(r.id).status == "cancelled"
    # cancelled on the frontend that runs it: aborted at once
    r = a.responses.create(model=MODEL, input=LONG, background=True, max_output_tokens=400)
    polled(a, r.id, timeout=0.3)
    assert a.responses.cancel(r.id).status == "cancelled"
    time.sleep(0.2)
    assert not engine.running
    # deleted while it runs: aborted too
    r = a.responses.create(model=MODEL, input=LONG, background=True, max_output_tokens=400)
    b.responses.delete(r.id)
    deadline = time.monotonic() + 5
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.running
    # created streamed and cancelled at once (review: then a 400 where it was read again, as if not streamed)
    with a.responses.create(model=MODEL, input=LONG, background=True, stream=True, max_output_tokens=400) as s:
        response_id = next(iter(s)).response.id
        assert b.responses.cancel(response_id).status == "cancelled"
    assert [e.type for e in b.responses.retrieve(response_id, stream=True)][:2] == ["response.created",
                                                                                    "response.queued"]
    fore = a.responses.create(model=MODEL, input="x", extra_body=STOP)
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.cancel(fore.id)
    assert "background" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        b.responses.cancel("resp_nope")


def test_a_background_stream_is_read_again_from_any_frontend(runs):
    """Created streamed: the caller reads its events as they come and may leave; the rest is read on another
    frontend from after the last it read (``starting_after``), or all of it again, the same events, ending with the
    Response as it is stored."""
    _, (a, b, _), _, _ = runs
    first, response_id = [], None
    with a.responses.create(model=MODEL, input=LONG, background=True, stream=True, max_output_tokens=60) as s:
        for event in s:
            first.append(event)
            response_id = response_id or event.response.id
            if len(first) == 6:
                break
    rest = list(b.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    whole = list(b.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in first + rest] == [e.sequence_number for e in whole] == list(range(len(whole)))
    assert [e.model_dump() for e in first + rest][1:-1] == [e.model_dump() for e in whole][1:-1]
    assert whole[-1].type == "response.incomplete"
    stored = a.responses.retrieve(response_id)
    assert whole[-1].response.model_dump() == stored.model_dump() and stored.output_text
    text = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert text == stored.output_text
    assert [e.type for e in whole[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert [e.response.status for e in whole[:3]] == ["queued", "queued", "in_progress"]
    # read whole with the client's own helper, the events checked in order as it rebuilds the Response; as soon as
    # its stream, or one read again elsewhere, has ended, it has ended everywhere (review: the last events were
    # stored before the Response, which read in_progress, and its continuation was a 400)
    for k in range(5):
        with a.responses.stream(model=MODEL, input=f"short {k}", background=True, extra_body=STOP) as s:
            done = s.get_final_response()
        assert done.background and b.responses.retrieve(done.id).output_text == done.output_text
        b.responses.create(model=MODEL, input="more", previous_response_id=done.id, extra_body=STOP)
        with a.responses.create(model=MODEL, input=LONG, background=True, stream=True, max_output_tokens=30) as s:
            response_id = next(iter(s)).response.id  # (and gone)
        ended = list(b.responses.retrieve(response_id, stream=True))
        assert ended[-1].type == "response.incomplete" and a.responses.retrieve(response_id).status == "incomplete"


def test_bad_background_calls_are_4xx(runs):
    _, (a, b, _), _, ports = runs
    with pytest.raises(openai.BadRequestError) as e:
        a.responses.create(model=MODEL, input="x", background=True, store=False)
    assert e.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as e:
        a.responses.create(model=MODEL, input="x", extra_body={"background": "yes"})
    assert e.value.body["param"] == "background"
    plain = a.responses.create(model=MODEL, input="x", background=True, extra_body=STOP)
    polled(a, plain.id)
    fore = a.responses.create(model=MODEL, input="x", extra_body=STOP)
    for rid in (plain.id, fore.id):  # (not created streamed: nothing to stream again)
        with pytest.raises(openai.BadRequestError) as e:
            list(b.responses.retrieve(rid, stream=True))
        assert e.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.retrieve(plain.id, extra_query={"stream": "true", "starting_after": "x"})
    assert e.value.body["param"] == "starting_after"
    url = f"http://127.0.0.1:{ports[1]}/v1/responses/{plain.id}"
    headers = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/cancel", headers=headers).status_code == 405
    assert httpx.post(url + "/other", headers=headers).status_code == 404
    assert httpx.post(url, headers=headers).status_code == 405
    for path in ("", "/input_items"):  # (review: a 405 since GET and DELETE were named, not HEAD)
        assert httpx.head(url + path, headers=headers).status_code == 200


def test_a_frontend_that_stops_fails_the_responses_it_ran(runs, smollm_tokenizer_dir):
    """A frontend stopped while it runs a background Response: the others read it as failed, not in progress."""
    engine, (_, b, _), store, _ = runs
    port = free_port()
    proc = start_frontend(engine.address, smollm_tokenizer_dir, port, api_keys=(KEY, OTHER_KEY),
                          frontend_id="fe-2", chat_template=SHOWN_TEMPLATE, responses_store=store)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        r = c.responses.create(model=MODEL, input=LONG, background=True, max_output_tokens=400)
        with c.responses.create(model=MODEL, input=LONG, background=True, stream=True, max_output_tokens=400) as s:
            streamed = next(iter(s)).response.id
        assert polled(b, r.id, timeout=0.3).status == "in_progress"
    finally:
        assert stop_frontend(proc) == 0
    got = b.responses.retrieve(r.id)
    assert got.status == "failed" and got.error.code == "server_error"
    events = list(b.responses.retrieve(streamed, stream=True))  # (its stream, read again, ends so too)
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    again = list(b.responses.retrieve(streamed, stream=True, starting_after=events[-2].sequence_number))
    assert [e.type for e in again] == ["response.failed"]


def test_a_background_turn_grows_its_conversation_and_a_refused_one_ends_failed(runs):
    """In a conversation, a background Response adds its input and output once it has ended, as a foreground one
    does; one the engine refuses (its queue full) ends ``failed``, saying why."""
    from engine.protocol import Error

    engine, (a, b, _), _, _ = runs
    conv = a.conversations.create(items=[{"type": "message", "role": "user", "content": "Q0"}])
    r = polled(b, a.responses.create(model=MODEL, input="Q1", conversation=conv.id, background=True,
                                     extra_body=STOP).id)
    assert r.status == "completed" and r.output_text == "user: Q0\nuser: Q1\n"
    items = b.conversations.items.list(conv.id, order="asc").data
    assert [i.content[0].text for i in items] == ["Q0", "Q1", "user: Q0\nuser: Q1\n"]
    engine.refuse = Error("", 429, "rate_limit_error", "the waiting queue is full")
    try:
        r = polled(b, a.responses.create(model=MODEL, input="Q2", background=True).id)
    finally:
        engine.refuse = None
    assert r.status == "failed" and r.error.code == "rate_limit_exceeded" and "queue is full" in r.error.message


def test_a_caller_gone_while_it_begins_leaves_no_run_half_begun(runs):
    """A client that drops its connection as soon as it has sent a background Response (review: 36 of 300 stayed
    ``queued`` with nothing running them, for as long as their frontend ran anything else): each is run, or never
    kept; none is left queued."""
    import socket
    import sqlite3
    import struct

    engine, (a, _, _), store, ports = runs
    body = orjson.dumps({"model": MODEL, "input": "gone", "background": True, "max_output_tokens": 4})
    head = (f"POST /v1/responses HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    for k in range(60):
        with socket.create_connection(("127.0.0.1", ports[k % 2])) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # (closed with a reset)
            sock.sendall(head + body)
            time.sleep(k % 10 / 1000)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        db = sqlite3.connect(store)
        left = db.execute("SELECT COUNT(*) FROM background").fetchone()[0]
        db.close()
        if not left and not engine.running:
            break
        time.sleep(0.1)
    assert left == 0 and not engine.running


def test_what_the_store_failed_to_take_is_written_again():
    """A write of a run's progress the store fails (a lock held past its wait, a full disk) loses nothing: its
    events, and that it has begun, go with the next write (review: the batch was lost, the log had a gap)."""
    import asyncio
    import types

    from frontends.background import BackgroundRuns
    from frontends.errors import ApiError

    written = []

    class Store:
        async def progress(self, response_id, runner, events, response):
            if not written:
                written.append(None)
                raise ApiError(503, "The response store failed: database is locked")
            written.append((list(events), response))
            run.ended = True  # (its last update came meanwhile: the rest is for finish)
            return True, True

    runs = BackgroundRuns(Store())
    run = types.SimpleNamespace(fmt=types.SimpleNamespace(log=[(0, b"e0"), (1, b"e1")]), begun=True, keeping=True,
                                ended=False, head={"id": "resp_x", "status": "in_progress"})

    async def flushed():
        write = asyncio.ensure_future(runs._flush(run))
        await asyncio.sleep(0)
        run.fmt.log.append((2, b"e2"))  # (made while the failed write was under way)
        return await write

    assert asyncio.run(flushed())
    assert written == [None, ([(0, b"e0"), (1, b"e1"), (2, b"e2")], run.head)] and run.fmt.log == []


def test_a_keys_runs_take_a_quarter_of_the_store_at_most(runs, smollm_tokenizer_dir, tmp_path):
    """Running background Responses are not counted against the store's bound; what bounds them is that one key's
    runs may take a quarter of it together: past it, a new one is a 429 (review: one key's 60 runs took 3.5 MB of a
    1 MiB store)."""
    engine, _, _, _ = runs
    port = free_port()
    proc = start_frontend(engine.address, smollm_tokenizer_dir, port, api_keys=(KEY,), frontend_id="fe-small",
                          chat_template=SHOWN_TEMPLATE, responses_store=str(tmp_path / "small.sqlite"),
                          responses_store_mib=1)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        turns = [*({"role": "user", "content": f"turn {k} " + "x " * 1000} for k in range(25)),  # (~50 KB, cut to
                 {"role": "user", "content": "go on"}]  # fit)
        started = []
        with pytest.raises(openai.RateLimitError) as e:
            for _ in range(10):
                started.append(c.responses.create(model=MODEL, input=turns, truncation="auto", background=True,
                                                  max_output_tokens=200))
        assert 3 <= len(started) <= 5 and "a quarter of --responses-store-mib" in e.value.body["message"]
        assert e.value.response.headers["retry-after"] == "1"
        conv = c.conversations.create()  # a turn refused so lets go of its conversation before the 429 is sent
        with pytest.raises(openai.RateLimitError):
            c.responses.create(model=MODEL, input=turns, truncation="auto", background=True, conversation=conv.id)
        c.responses.create(model=MODEL, input="Q", conversation=conv.id, max_output_tokens=1)  # (not locked)
        for r in started:
            c.responses.cancel(r.id)
        c.responses.create(model=MODEL, input=turns, truncation="auto", background=True, max_output_tokens=1)
    finally:
        assert stop_frontend(proc) == 0


def test_one_turn_at_a_time_runs_on_a_conversation(runs):
    """OpenAI's ``conversation_locked``: while a turn runs on a conversation (background, or a stream), another turn
    on it, on either frontend, is that 400; once the turn has ended (done, cancelled, its stream dropped, or refused),
    the next one runs, and the conversation holds each turn whole, in order."""
    _, (a, b, _), _, _ = runs
    conv = a.conversations.create()
    r = a.responses.create(model=MODEL, input=LONG, conversation=conv.id, background=True, max_output_tokens=100)
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.create(model=MODEL, input="Q2", conversation=conv.id, extra_body=STOP)
    assert e.value.body["code"] == "conversation_locked" and e.value.response.headers["retry-after"] == "1"
    assert polled(b, r.id).status == "incomplete"
    b.responses.create(model=MODEL, input="Q2", conversation=conv.id, extra_body=STOP)  # (ended: its turn's after)
    assert [i.content[0].text[:7] for i in b.conversations.items.list(conv.id, order="asc").data] == [
        "a story", "user: a", "Q2", "user: a"]
    conv = a.conversations.create()  # (a new one: the first grew long)
    r = a.responses.create(model=MODEL, input=LONG, conversation=conv.id, background=True, max_output_tokens=300)
    b.responses.cancel(r.id)
    b.responses.create(model=MODEL, input="Q3", conversation=conv.id, extra_body=STOP)  # (cancelled: let go of)
    conv = a.conversations.create()
    with a.responses.create(model=MODEL, input=LONG, conversation=conv.id, stream=True, max_output_tokens=300) as s:
        next(iter(s))
        with pytest.raises(openai.BadRequestError) as e:
            b.responses.create(model=MODEL, input="Q4", conversation=conv.id, extra_body=STOP)
        assert e.value.body["code"] == "conversation_locked"
    deadline = time.monotonic() + 5  # (the stream dropped: let go of as it closes)
    while True:
        try:
            b.responses.create(model=MODEL, input="Q4", conversation=conv.id, extra_body=STOP)
            break
        except openai.BadRequestError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with pytest.raises(openai.BadRequestError):  # (refused before it ran: let go of at once)
        a.responses.create(model=MODEL, input="Q5", conversation=conv.id, max_output_tokens=-1)
    b.responses.create(model=MODEL, input="Q5", conversation=conv.id, extra_body=STOP)
