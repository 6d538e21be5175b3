"""The HTTP/1.1 layer over raw sockets: a server in a thread with a few toy routes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from frontends.http import HttpConfig, HttpServer, Response, Router, StreamingResponse, Upgrade

CLOSED: list[str] = []


async def echo(req):
    return Response(200, bytes(req.body), "application/octet-stream", [("x-path", req.path)])


async def slow(req):
    await asyncio.sleep(0.2)
    return Response(200, b"slow")


async def stream(req):
    async def chunks():
        for i in range(3):
            yield b"data: %d\n\n" % i

    return StreamingResponse(chunks(), on_close=lambda: CLOSED.append("stream"))


async def forever(req):
    async def chunks():
        while True:
            yield b"x" * 65536
            await asyncio.sleep(0)

    return StreamingResponse(chunks(), on_close=lambda: CLOSED.append("forever"))


async def boom(req):
    raise RuntimeError("handler bug")


class Shout(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(data.upper())


async def upgrade(req):
    return Upgrade(Shout(), b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: shout\r\nConnection: Upgrade\r\n\r\n")


@pytest.fixture(scope="module")
def port():
    router = Router()
    router.add("POST", "/echo", echo)
    router.add("GET", "/slow", slow)
    router.add("GET", "/stream", stream)
    router.add("GET", "/forever", forever)
    router.add("GET", "/boom", boom)
    router.add_upgrade("/v1/stream", upgrade)
    server = HttpServer(router, HttpConfig(max_body_bytes=1000, header_timeout=0.5, keep_alive_timeout=0.5))
    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(loop.create_server(server, "127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield srv.sockets[0].getsockname()[1]
    loop.call_soon_threadsafe(loop.stop)


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=3)
    return s


def read_until(s: socket.socket, marker: bytes, count: int = 1) -> bytes:
    buf = b""
    while buf.count(marker) < count:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def read_all(s: socket.socket) -> bytes:
    buf = b""
    while chunk := s.recv(65536):
        buf += chunk
    return buf


def post_echo(body: bytes, extra: bytes = b"") -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%b\r\n%b" % (len(body), extra, body)


def test_keep_alive_reuse(port):
    s = connect(port)
    for i in range(3):
        s.sendall(post_echo(b"hello %d" % i))
        r = read_until(s, b"hello %d" % i)
        assert r.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-path: /echo" in r


def test_pipelined_answers_in_order(port):
    s = connect(port)
    s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + post_echo(b"second") + post_echo(b"third"))
    r = read_until(s, b"third")
    assert r.index(b"slow") < r.index(b"second") < r.index(b"third")


def test_chunked_request_body(port):
    s = connect(port)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    assert read_until(s, b"hello world").endswith(b"\r\n\r\nhello world")


def test_a_transfer_coding_other_than_chunked_is_501(port):
    """RFC 9112 6.1: llhttp reads "gzip, chunked" as chunked, and the body would be taken still compressed."""
    for codings in (b"Transfer-Encoding: gzip, chunked", b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked"):
        s = connect(port)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + codings + b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        r = read_all(s)
        assert r.startswith(b"HTTP/1.1 501 ") and b"Transfer-Encoding gzip, chunked is not supported" in r, r
    s = connect(port)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert read_until(s, b"hello").endswith(b"\r\n\r\nhello")  # (the one coding, in any case)


def test_body_limit_413(port):
    s = connect(port)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 100)
    r = read_all(s)
    assert r.startswith(b"HTTP/1.1 413 ") and b'"error"' in r
    s = connect(port)  # chunked bodies count too
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"3e8\r\n" + b"y" * 1000
              + b"\r\n3e8\r\n" + b"y" * 1000 + b"\r\n")
    assert read_all(s).startswith(b"HTTP/1.1 413 ")


def test_expect_100_continue(port):
    s = connect(port)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert read_until(s, b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    s.sendall(b"body")
    assert read_until(s, b"body").startswith(b"HTTP/1.1 200 OK")
    s = connect(port)  # too big: 413 instead of 100
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\nExpect: 100-continue\r\n\r\n")
    assert read_all(s).startswith(b"HTTP/1.1 413 ")
    s = connect(port)  # any other expectation: 417, its body never waited for
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 200-ok\r\n\r\n")
    r = read_all(s)
    assert r.startswith(b"HTTP/1.1 417 ") and b'"error"' in r and b"200-ok" in r
    for lines in (b"Expect: foo\r\nExpect: 100-continue", b"Expect: 100-continue, foo"):  # every line counts
        s = connect(port)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n" + lines + b"\r\n\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 417 ")
    # no 100 where no body is to come, nor to an HTTP/1.0 client (RFC 9110 10.1.1: it ignores the expectation)
    s = connect(port)
    s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n")
    assert read_until(s, b"\r\n\r\n").startswith(b"HTTP/1.1 200 ")
    s = connect(port)
    s.sendall(b"POST /echo HTTP/1.0\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    time.sleep(0.1)
    s.sendall(b"body")
    assert read_all(s).startswith(b"HTTP/1.1 200 ")


def test_streaming_chunked_response(port):
    s = connect(port)
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    r = read_until(s, b"\r\n0\r\n\r\n")  # (the last chunk's: a request id may end the headers with "0\r\n\r\n")
    assert b"transfer-encoding: chunked" in r
    assert b"9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n" in r
    s.sendall(post_echo(b"after stream"))  # the connection is still good
    assert read_until(s, b"after stream").startswith(b"HTTP/1.1 200")


def test_an_http10_client_gets_a_stream_up_to_the_close(port):
    """RFC 9112 6.1: no transfer coding in an answer to HTTP/1.0 (review: a 1.0 client was sent chunk sizes);
    a stream then ends as the connection closes, whatever the client asked for."""
    for extra in (b"", b"Connection: keep-alive\r\n"):
        s = connect(port)
        s.sendall(b"GET /stream HTTP/1.0\r\n%b\r\n" % extra)
        head, _, body = read_all(s).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head and b"connection: close" in head
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_flow_control_and_disconnect(port):
    CLOSED.clear()
    s = connect(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
    s.recv(1000)
    time.sleep(0.3)  # the server must be paused by now, not buffering without end
    s.close()
    deadline = time.time() + 3
    while "forever" not in CLOSED and time.time() < deadline:
        time.sleep(0.02)
    assert "forever" in CLOSED


def test_routing_and_handler_errors(port):
    s = connect(port)
    s.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_until(s, b"}}").startswith(b"HTTP/1.1 405 ")
    s.sendall(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_until(s, b"}}").startswith(b"HTTP/1.1 404 ")
    s.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_until(s, b"}}").startswith(b"HTTP/1.1 500 ")
    s.sendall(post_echo(b"still alive"))
    assert read_until(s, b"still alive").startswith(b"HTTP/1.1 200")


def test_a_connect_is_refused_and_says_the_connection_closes(port):
    """The parser reads nothing after a CONNECT (llhttp takes it as an upgrade): its 405 says so, before the
    close (it said keep-alive, and a client reusing the connection met a reset: review)."""
    for target in (b"/echo", b"x:443"):  # (a path's method, or a proxy's target: not llhttp's "User callback error")
        s = connect(port)
        s.sendall(b"CONNECT %b HTTP/1.1\r\nHost: x\r\n\r\n" % target)
        r = read_all(s)
        assert r.startswith(b"HTTP/1.1 405 ") and b"\r\nconnection: close\r\n" in r.lower(), r
    assert b"CONNECT is not supported" in r, r


def test_malformed_request_400(port):
    s = connect(port)
    s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    assert read_all(s).startswith(b"HTTP/1.1 400 ")


def test_an_http11_request_takes_one_host(port):
    """RFC 9112 3.2: an HTTP/1.1 request without ``Host``, or any with two, is a 400 (the rules that read
    ``Host``, the loopback one in ``frontends.auth``, would otherwise read one a proxy may not have); HTTP/1.0
    may leave it out. The request before it on the connection is answered."""
    for head, status in ((b"GET /slow HTTP/1.1\r\n", b"400"), (b"GET /slow HTTP/1.1\r\nHost: x\r\nhost: y\r\n", b"400"),
                         (b"GET /slow HTTP/1.0\r\n", b"200"), (b"GET /slow HTTP/1.0\r\nHost: x\r\nHost: y\r\n", b"400")):
        s = connect(port)
        s.sendall(post_echo(b"first") + head + b"\r\n")
        r = read_all(s)
        assert r.startswith(b"HTTP/1.1 200 ") and b"first" in r, head
        second = r[r.index(b"HTTP/1.1", 10):]
        assert second.startswith(b"HTTP/1.1 %b " % status), (head, second)
        if status == b"400":
            assert b"Host header" in second and b"connection: close" in second.lower()


def test_header_and_idle_timeouts(port):
    s = connect(port)
    s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")  # headers never finish
    t = time.time()
    assert read_all(s).startswith(b"HTTP/1.1 408 ") and time.time() - t < 2
    s = connect(port)
    s.sendall(post_echo(b"idle"))
    read_until(s, b"idle")
    t = time.time()
    assert read_all(s) == b"" and 0.3 < time.time() - t < 2  # closed after the keep-alive timeout


def test_upgrade_hands_over_transport(port):
    s = connect(port)
    s.sendall(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: shout\r\n\r\nearly")
    r = read_until(s, b"EARLY")
    assert r.startswith(b"HTTP/1.1 101 ") and r.endswith(b"EARLY")
    s.sendall(b"more")
    assert s.recv(100) == b"MORE"


def test_an_upgrade_no_route_takes_is_ignored(port):
    """RFC 9110 7.8: a server may ignore an Upgrade. ``curl --http2`` on http:// asks for h2c, with the body after
    the head (review: llhttp stops at the head of an upgrade request, and such a body was served empty)."""
    s = connect(port)
    h2c = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
    s.sendall(post_echo(b"hello", h2c) + post_echo(b"again"))  # (pipelined: the connection goes on)
    r = read_until(s, b"again")
    assert r.startswith(b"HTTP/1.1 200 OK\r\n") and r.count(b"200 OK") == 2 and b"hello" in r
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
    time.sleep(0.05)  # (the rest of the body in another read)
    s.sendall(b"2\r\nde\r\n0\r\n\r\n")
    r = read_until(s, b"abcde")
    assert r.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close" not in r.lower()
    s.sendall(post_echo(b"expected", h2c + b"Expect: 100-continue\r\n"))
    r = read_until(s, b"expected")
    assert r.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n") and r.count(b"100 Continue") == 1
    s.sendall(b"GET /slow HTTP/1.0\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")  # (1.0: closed after)
    r = read_all(s)
    assert r.startswith(b"HTTP/1.1 200 OK\r\n") and r.endswith(b"slow")


def test_ignored_upgrades_in_odd_shapes_and_many_at_once(port):
    """Review of the above: 1200 such requests pipelined in one write (each was read again one call deeper, and
    Python's recursion limit cut them off), a Connection token that is no UTF-8, an empty last Upgrade header
    (llhttp upgrades on any), and a head just under the limit whose Connection header is all commas."""
    s = connect(port)
    h2c = b"Connection: Upgrade\r\nUpgrade: h2c\r\n"
    s.sendall(b"".join(post_echo(b"<%d>" % i, h2c) for i in range(1200)))
    r = read_until(s, b"<1199>")
    assert r.count(b"HTTP/1.1 200 OK") == 1200 and r.index(b"<0>") < r.index(b"<1>") < r.index(b"<1199>")
    for extra in (b"Connection: Upgrade, caf\xe9\r\nUpgrade: h2c\r\n", b"Connection: Upgrade\r\nUpgrade: h2c\r\nUpgrade: \r\n"):
        s.sendall(post_echo(b"odd", extra) + post_echo(b"next"))
        r = read_until(s, b"next")
        assert r.count(b"HTTP/1.1 200 OK") == 2 and b"\r\n\r\nodd" in r
    commas = b"Connection: Upgrade," + b",".join([b"a"] * 30000) + b"\r\nUpgrade: h2c\r\n"
    pad = b"X: " + b"b" * (HttpConfig().max_header_bytes - len(post_echo(b"big", commas)) - 20) + b"\r\n"
    s.sendall(post_echo(b"big", commas + pad))
    assert read_until(s, b"big").startswith(b"HTTP/1.1 200 OK")


def test_an_answer_is_observed_before_the_client_has_all_of_it():
    """The observer (the metrics) runs before an answer's last byte leaves: a client holding its
    whole answer finds it counted, even when another frontend process serves the scrape."""
    observed = []

    def observer(req, status):
        time.sleep(0.2)  # a frontend descheduled between its answer and its count
        observed.append((req.path, status, time.monotonic()))

    router = Router()
    router.add("POST", "/echo", echo)
    router.add("GET", "/stream", stream)
    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(loop.create_server(HttpServer(router, observer=observer), "127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        s = connect(srv.sockets[0].getsockname()[1])
        s.sendall(post_echo(b"plain"))
        read_until(s, b"plain")
        plain_at = time.monotonic()
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        read_until(s, b"\r\n0\r\n\r\n")  # (the last chunk)
        stream_at = time.monotonic()
        assert [(path, status) for path, status, _ in observed] == [("/echo", 200), ("/stream", 200)]
        assert observed[0][2] <= plain_at and observed[1][2] <= stream_at
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_head_is_answered_as_its_get_without_the_body(port):
    """RFC 9110: the GET's status and headers (its length too), no body; the connection goes on. A stream's head
    alone, its generator closed. A path with a GET names HEAD among its methods in a 405."""
    s = connect(port)
    s.sendall(b"HEAD /slow HTTP/1.1\r\nHost: x\r\n\r\nHEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.5)
    s.sendall(post_echo(b"after"))
    got = read_until(s, b"after")
    heads = got.split(b"\r\n\r\n")
    assert heads[0].startswith(b"HTTP/1.1 200") and b"content-length: 4" in heads[0]  # (b"slow": not sent)
    assert heads[1].startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in heads[1]
    assert heads[2].startswith(b"HTTP/1.1 200") and got.endswith(b"after") and b"slow" not in got
    assert b"data:" not in got
    s.sendall(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n")  # (its 405: the head alone too)
    assert read_until(s, b"\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    s.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert b"allowed: GET, HEAD" in read_until(s, b"}}")
    # a careless client's HEAD with a body: read and dropped, the next request framed as its own
    s.sendall(b"HEAD /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello" + post_echo(b"next"))
    got = read_until(s, b"next")
    assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1 200") == 2 and b"hello" not in got
    s.sendall(b"HEAD /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")  # past the limit: 413, closed
    got = read_all(s)
    assert got.startswith(b"HTTP/1.1 413 ") and got.endswith(b"\r\n\r\n") and b"connection: close" in got
    s.close()


def test_a_trusted_proxy_names_the_client():
    """``forwarded_allow_ips`` (uvicorn's rule): from a trusted peer, the rightmost X-Forwarded-For entry that is no
    trusted proxy (all of them are: the leftmost), the headers joined in order; from any other peer, or with none
    trusted, the header is the client's own word and ignored."""
    from frontends.http import TrustedProxies

    def hdrs(*values: str) -> list[tuple[bytes, bytes]]:
        return [(b"Host", b"x")] + [(b"X-Forwarded-For", v.encode()) for v in values]

    local = TrustedProxies(("127.0.0.1",))
    assert local.client(hdrs("203.0.113.7"), "127.0.0.1:5000") == "203.0.113.7"
    assert local.client(hdrs("203.0.113.7"), "10.0.0.2:5000") is None  # (not a proxy of ours)
    assert local.client(hdrs("spoofed, 203.0.113.7, 127.0.0.1"), "127.0.0.1:1") == "203.0.113.7"
    assert local.client(hdrs("127.0.0.1", " 127.0.0.1 "), "127.0.0.1:1") == "127.0.0.1"
    assert local.client(hdrs("spoofed, 198.51.100.1", "203.0.113.7"), "127.0.0.1:1") == "203.0.113.7"
    assert local.client(hdrs(" , "), "127.0.0.1:1") is None and local.client(hdrs(), "127.0.0.1:1") is None
    for junk in ("x" * 1000, "unknown", "[::1", "a b"):  # (no address: it names no client, review)
        assert local.client(hdrs(junk), "127.0.0.1:1") is None
    assert local.client(hdrs("unknown, 203.0.113.7"), "127.0.0.1:1") == "203.0.113.7"
    for hop, host in (("9.9.9.9:1234", "9.9.9.9"), ("[2001:db8::3]:443", "2001:db8::3"), ("[2001:db8::2]", "2001:db8::2"),
                      ("2001:db8::5", "2001:db8::5")):  # (a port a proxy writes is no part of who the client is)
        assert local.client(hdrs(hop), "127.0.0.1:1") == host
    assert local.client(hdrs(", ".join(["203.0.113.7"] + ["127.0.0.1"] * 5000)), "127.0.0.1:1") == "127.0.0.1"
    # (only the last 32 hops are read: past them, as if all were proxies)
    nets = TrustedProxies(("10.0.0.0/8", "::1"))
    assert nets.client(hdrs("2001:db8::5, 10.1.2.3"), "10.9.9.9:80") == "2001:db8::5"
    assert nets.client(hdrs("203.0.113.7"), "::1:80") == "203.0.113.7"
    assert nets.client(hdrs("203.0.113.7"), "11.0.0.1:80") is None
    assert TrustedProxies(("*",)).client(hdrs("192.0.2.7, 192.0.2.8"), "192.0.2.1:80") == "192.0.2.7"  # (the leftmost)
    assert TrustedProxies(()).client(hdrs("203.0.113.7"), "127.0.0.1:1") is None
    from frontends.access_log import _peer
    from frontends.http import Request
    req = Request()
    assert _peer(req) == "-" and req.client == "-"
    req.forwarded_for = "203.0.113.7"  # (what the access log names, as uvicorn's does)
    assert _peer(req) == req.client == "203.0.113.7"
