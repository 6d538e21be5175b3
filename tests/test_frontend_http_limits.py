"""The HTTP layer's limits on slow and greedy clients: one client must never stall anyone else.

Raw sockets against ``HttpServer``s in a thread, with timeouts of a fraction of a
second: slowloris heads and bodies (408), pipelined heads that stall behind a slow
answer, oversized heads (431), the connection limit (503, or room made by the longest waiting connection), and a client that
stops reading a stream (cut after ``write_timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time

import pytest

from frontends.http import EVICT_AFTER, HttpConfig, HttpServer, Response, Router, Upgrade
from tests.test_frontend_http import CLOSED, connect, echo, forever, post_echo, read_all, read_until

LIMITS = HttpConfig(max_body_bytes=1000, header_timeout=0.4, body_timeout=0.3, min_body_rate=10, keep_alive_timeout=0.5,
                    write_timeout=0.3, max_header_bytes=2048)


async def sleepy(req):
    await asyncio.sleep(1.0)
    return Response(200, b"sleepy")


class Held(asyncio.Protocol):
    """An upgraded connection that registers with the server, as ``websocket.Connection`` does."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server

    def connection_made(self, transport):
        self.server.connections.add(self)

    def connection_lost(self, exc):
        self.server.connections.discard(self)


@contextlib.contextmanager
def serving(config: HttpConfig):
    router = Router()
    router.add("POST", "/echo", echo)
    router.add("GET", "/sleepy", sleepy)
    router.add("GET", "/forever", forever)
    server = HttpServer(router, config)

    async def hold(req):
        head = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: held\r\nConnection: Upgrade\r\n\r\n"
        return Upgrade(Held(server), head)

    router.add_upgrade("/held", hold)
    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(loop.create_server(server, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield srv.sockets[0].getsockname()[1], server
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(2)


@pytest.fixture(scope="module")
def port():
    with serving(LIMITS) as (p, _):
        yield p


def test_stalled_body_gets_408(port):
    s = connect(port)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    t = time.time()
    r = read_all(s)
    assert r.startswith(b"HTTP/1.1 408 ") and b'"timeout_error"' in r and b"connection: close" in r
    assert 0.25 < time.time() - t < 2
    s = connect(port)  # a body that trickles in slower than the header timeout but never pauses is fine
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\n")
    for b in b"tickle":
        time.sleep(0.12)
        s.sendall(bytes([b]))
    assert read_until(s, b"tickle").startswith(b"HTTP/1.1 200 ")


def test_a_body_that_trickles_in_for_ever_gets_408(port):
    """A byte every 0.2 s never pauses for the body timeout (0.3 s), but averages 5 bytes a second where 10 are
    due past the first 0.3 s: cut at about 0.4 s (the review: a byte every few seconds held a connection, and
    enough of them every connection a frontend takes, with no API key)."""
    s = connect(port)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    t = time.time()
    while not select.select([s], [], [], 0.2)[0] and time.time() - t < 3:
        s.sendall(b"x")
    r = read_all(s)
    assert r.startswith(b"HTTP/1.1 408 ") and b"too slow: under 10 bytes a second" in r
    assert 0.3 < time.time() - t < 1.5


def test_a_body_sent_at_once_then_trickling_gets_408(port):
    """900 bytes at once bank at most one body timeout (0.3 s) of credit, not 90 s (review: 31 MiB at once, then a
    byte every 20 s, held a connection, and its 31 MiB, for 18 hours): a byte every 0.2 s after them is cut soon."""
    s = connect(port)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 900)
    t = time.time()
    while not select.select([s], [], [], 0.2)[0] and time.time() - t < 5:
        s.sendall(b"x")
    r = read_all(s)
    assert r.startswith(b"HTTP/1.1 408 ") and b"too slow: under 10 bytes a second" in r
    assert time.time() - t < 1.5


def test_bodies_coming_at_once_are_bounded_by_a_frontend_budget():
    """max_receiving_bytes: the body whose bytes would take every connection's bodies still coming past it gets 503
    (review: 1024 connections each with a slow 8 MiB body pinned 8 GiB of a frontend); the budget comes back as
    bodies end, are refused, or lose their connection."""
    config = HttpConfig(max_body_bytes=1000, max_receiving_bytes=1500, header_timeout=5, body_timeout=5)
    with serving(config) as (port, server):
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        a = connect(port)
        a.sendall(head + b"a" * 900)
        deadline = time.time() + 5
        while server.receiving < 900 and time.time() < deadline:
            time.sleep(0.01)
        b = connect(port)
        b.sendall(head + b"b" * 700)
        r = read_all(b)
        assert r.startswith(b"HTTP/1.1 503 ") and b"Too many request bodies coming at once" in r
        a.sendall(b"a" * 100)
        assert read_until(a, b"a" * 1000).startswith(b"HTTP/1.1 200 ")
        c = connect(port)  # (a's 900 bytes back in the budget)
        c.sendall(head + b"c" * 1000)
        assert read_until(c, b"c" * 1000).startswith(b"HTTP/1.1 200 ")
        d = connect(port)
        d.sendall(head + b"d" * 600)
        while server.receiving < 600 and time.time() < deadline:
            time.sleep(0.01)
        d.close()  # (a connection lost mid-body gives its bytes back)
        _given_back(server, a, b, c)


def _given_back(server: HttpServer, *socks: socket.socket) -> None:
    """``socks`` closed: every body byte of the server's budget comes back."""
    for s in socks:
        s.close()
    deadline = time.time() + 5
    while server.receiving and time.time() < deadline:
        time.sleep(0.01)
    assert server.receiving == 0


def test_a_body_left_idle_gives_way_to_a_new_one_past_the_budget():
    """Past max_receiving_bytes, a body that has come for EVICT_AFTER or more and lately at almost nothing (a trickle
    that held its bytes: one client's slow bodies made everyone's 503 until they ended) gets the 503 and the new body
    goes on; a body younger than that is kept, and the new one refused, as before."""
    config = HttpConfig(max_body_bytes=1000, max_receiving_bytes=1500, header_timeout=5, body_timeout=5,
                        min_body_rate=0)
    with serving(config) as (port, server):
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        old = connect(port)
        old.sendall(head + b"o" * 900)  # and then nothing (within body_timeout)
        deadline = time.time() + 5
        while server.receiving < 900 and time.time() < deadline:
            time.sleep(0.01)
        young = connect(port)
        young.sendall(head + b"y" * 700)
        assert read_all(young).startswith(b"HTTP/1.1 503 ")  # (the old one has come for less than EVICT_AFTER)
        time.sleep(EVICT_AFTER)
        new = connect(port)
        new.sendall(head + b"n" * 1000)
        assert read_until(new, b"n" * 1000).startswith(b"HTTP/1.1 200 ")
        r = read_all(old)
        assert r.startswith(b"HTTP/1.1 503 ") and b"gave way" in r
        _given_back(server, old, young, new)


def test_an_upload_under_way_is_kept_and_none_gives_way_for_nothing():
    """Past the budget, only bodies coming slowest lately (under EVICT_RATE) give way: an upload sending at a usable
    rate is kept, though older than the idle body that goes (review X: one under way at 200 KB/s was the victim of
    bodies sent at once and then left); and none gives way where all the slow ones would not make room."""
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    config = HttpConfig(max_body_bytes=200_000, max_receiving_bytes=300_000, header_timeout=5, body_timeout=5,
                        min_body_rate=0)
    with serving(config) as (port, server):
        active = connect(port)
        active.sendall(head % 200_000)
        sent = 0

        def send(k: int) -> None:
            nonlocal sent
            for _ in range(k):
                active.sendall(b"a" * 4000)  # 80 KB a second
                sent += 4000
                time.sleep(0.05)

        send(4)
        idle = connect(port)
        idle.sendall(head % 200_000 + b"i" * 100_000)  # and then nothing
        send(int(EVICT_AFTER / 0.05) + 4)  # both older than EVICT_AFTER now
        new = connect(port)
        new.sendall(head % 100_000 + b"w" * 100_000)
        assert read_until(new, b"w" * 100_000).startswith(b"HTTP/1.1 200 ")
        r = read_all(idle)
        assert r.startswith(b"HTTP/1.1 503 ") and b"coming slowest, gave way" in r
        active.sendall(b"a" * (200_000 - sent))
        assert read_until(active, b"a" * 1000).startswith(b"HTTP/1.1 200 ")
    config = HttpConfig(max_body_bytes=2000, max_receiving_bytes=3000, header_timeout=5, body_timeout=5,
                        min_body_rate=0)
    with serving(config) as (port, server):
        old, young = connect(port), connect(port)
        old.sendall(head % 2000 + b"o" * 500)
        time.sleep(EVICT_AFTER + 0.1)
        young.sendall(head % 2000 + b"y" * 1400)
        deadline = time.time() + 5
        while server.receiving < 1900 and time.time() < deadline:
            time.sleep(0.01)
        third = connect(port)  # 1900 + 1700 - 500 (the old one's) > 3000: refused, and the old one kept
        third.sendall(head % 1700 + b"t" * 1700)
        assert read_all(third).startswith(b"HTTP/1.1 503 ")
        assert server.receiving == 1900  # (the old one's 500 still coming)


def test_header_timeout_fires_behind_a_pipelined_request(port):
    s = connect(port)
    s.sendall(b"GET /sleepy HTTP/1.1\r\nHost: x\r\n\r\nGET /sleepy HTTP/1.1\r\nHo")  # the second never ends
    t = time.time()
    r = read_all(s)  # the first is answered, then the second gets its 408 in turn, then the close
    assert r.startswith(b"HTTP/1.1 200 ") and r.index(b"sleepy") < r.index(b"HTTP/1.1 408 ")
    assert time.time() - t < 2.5
    s = connect(port)  # an idle keep-alive connection is just closed
    s.sendall(post_echo(b"idle"))
    read_until(s, b"idle")
    assert read_all(s) == b""


def test_body_timeout_fires_behind_a_pipelined_request(port):
    s = connect(port)
    s.sendall(b"GET /sleepy HTTP/1.1\r\nHost: x\r\n\r\n"
              b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nab")  # 7 body bytes never come
    r = read_all(s)
    assert r.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in r


def test_a_body_sent_before_its_100_continue_is_timed_as_it_comes():
    """A body behind an answer still going, its 100 held back, that comes without waiting for it is timed from its
    first bytes (it was timed only once the 100 went, after that answer: a trickle held its bytes of the server's
    body budget as long as the answer lasted); no 100 is sent for it then."""
    with serving(LIMITS) as (port, server):
        s = connect(port)
        s.sendall(b"GET /sleepy HTTP/1.1\r\nHost: x\r\n\r\n"  # (1 s)
                  b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\nExpect: 100-continue\r\n\r\n")
        time.sleep(0.05)
        s.sendall(b"ab")  # and the rest never comes
        time.sleep(0.1)
        assert server.receiving == 2
        time.sleep(0.5)  # past body_timeout (0.3 s), the answer ahead still going
        assert server.receiving == 0  # refused: its bytes given back
        r = read_all(s)
        assert r.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in r and b"100 Continue" not in r


def _send_until_answered(s: socket.socket, first: bytes, more: bytes, times: int) -> bytes:
    s.sendall(first)
    for _ in range(times):
        if select.select([s], [], [], 0.02)[0]:
            break  # answered: stop sending
        s.sendall(more)
    return read_all(s)


def test_oversized_head_gets_431(port):
    # one header that never ends, in small reads: httptools would buffer it without end
    r = _send_until_answered(connect(port), b"GET /sleepy HTTP/1.1\r\nHost: x\r\nX-Big: ", b"a" * 300, 40)
    assert r.startswith(b"HTTP/1.1 431 ") and b"2048 bytes" in r
    # many small headers, all in one read
    head = b"GET /sleepy HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 50)
                                                        for i in range(60))
    s = connect(port)
    s.sendall(head + b"\r\n")
    assert read_all(s).startswith(b"HTTP/1.1 431 ")
    s = connect(port)  # and a long URL
    s.sendall(b"GET /" + b"u" * 3000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_all(s).startswith(b"HTTP/1.1 431 ")
    s = connect(port)  # a head under the limit after a pipelined request with a body is fine
    s.sendall(post_echo(b"z" * 900) + b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 1500
              + b"\r\nContent-Length: 4\r\n\r\nlast")
    r = read_until(s, b"last")
    assert r.count(b"HTTP/1.1 200 ") == 2


def test_connection_limit_503(port):
    with serving(HttpConfig(max_connections=2)) as (p, server):
        held = connect(p)  # an upgraded connection (a WebSocket, say) counts too
        held.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: held\r\n\r\n")
        assert read_until(held, b"\r\n\r\n").startswith(b"HTTP/1.1 101 ")
        busy = connect(p)
        busy.sendall(post_echo(b"one"))
        assert read_until(busy, b"one").startswith(b"HTTP/1.1 200 ")
        t = time.time()
        r = read_all(connect(p))  # no request needed: the answer is immediate
        assert r.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1\r\n" in r and b"connection: close" in r
        assert b'"service_unavailable_error"' in r and time.time() - t < 1
        busy.close()
        deadline = time.time() + 2
        while len(server.connections) > 1 and time.time() < deadline:
            time.sleep(0.01)
        again = connect(p)
        again.sendall(post_echo(b"two"))
        assert read_until(again, b"two").startswith(b"HTTP/1.1 200 ")


def test_at_the_limit_the_longest_waiting_connection_makes_room(port):
    """Review: 1024 connections that send nothing (or half a head, a byte now and then) held every client off with
    503s for up to --header-timeout, and again as soon as they were made anew. At the limit, the connection that
    has waited longest for a request (a second or more) is closed for a new one; one whose request is under way is
    never (the limit's 503 then, as above)."""
    with serving(HttpConfig(max_connections=2, header_timeout=30, keep_alive_timeout=30)) as (p, server):
        silent = connect(p)
        time.sleep(0.1)
        slowloris = connect(p)
        slowloris.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        r = read_all(connect(p))  # (they have waited under a second: this one is refused)
        assert r.startswith(b"HTTP/1.1 503 ")
        time.sleep(1.1)
        fresh = connect(p)
        fresh.sendall(post_echo(b"in"))
        assert read_until(fresh, b"in").startswith(b"HTTP/1.1 200 ")
        assert silent.recv(100) == b""  # (the longest waiting: closed without a word)
        slowloris.sendall(b"X: y\r\n")
        later = connect(p)  # the slowloris, now the longest waiting, makes room next
        later.sendall(post_echo(b"later"))
        assert read_until(later, b"later").startswith(b"HTTP/1.1 200 ")
        assert read_all(slowloris) == b""
        for c in (fresh, later):
            c.sendall(b"GET /sleepy HTTP/1.1\r\nHost: x\r\n\r\n")  # (answered after 1 s: under way until then)
        time.sleep(0.2)
        assert read_all(connect(p)).startswith(b"HTTP/1.1 503 ")
        assert read_until(fresh, b"sleepy").endswith(b"sleepy") and read_until(later, b"sleepy").endswith(b"sleepy")


def test_a_connection_whose_client_reads_nothing_of_its_last_answer_is_neither_room_nor_kept(port):
    """Review of the above: a client that never read its 60 KB answer (most of it still in the transport's buffer, so
    the connection looked idle) was closed to make room, and a close waits for what is written to go: it stayed open,
    out of the count, for good. Such a connection is not room; closed (here by the keep-alive timer), it is reset once
    its client has read nothing for ``write_timeout``, as a stream's is."""
    config = HttpConfig(max_connections=1, socket_send_buffer=8192, keep_alive_timeout=1.5, write_timeout=0.3,
                        max_body_bytes=100_000)
    with serving(config) as (p, server):
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", p))
        stuck.sendall(post_echo(b"x" * 60_000))
        time.sleep(EVICT_AFTER + 0.1)
        r = read_all(connect(p))  # (within its keep-alive: the limit's 503, not the stuck one closed)
        assert r.startswith(b"HTTP/1.1 503 ")
        deadline = time.time() + 5
        while server.connections and time.time() < deadline:
            time.sleep(0.02)
        assert not server.connections
        again = connect(p)
        again.sendall(post_echo(b"in"))
        assert read_until(again, b"in").startswith(b"HTTP/1.1 200 ")
        stuck.settimeout(2)
        with pytest.raises(ConnectionResetError):
            while stuck.recv(1 << 20):
                pass


def test_stream_to_a_client_that_never_reads_is_cut(port):
    CLOSED.clear()
    s = connect(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
    deadline = time.time() + 3
    while "forever" not in CLOSED and time.time() < deadline:
        time.sleep(0.02)
    assert "forever" in CLOSED  # on_close ran: the handler's engine requests would be aborted
    s.settimeout(2)
    with pytest.raises(ConnectionResetError):  # reset: the server dropped what was never read
        while s.recv(1 << 20):
            pass
