"""A small HTTP/1.1 server: an asyncio Protocol on ``httptools.HttpRequestParser``.

Owns the connection: keep-alive, pipelined requests answered in order (one
worker task per connection serves its queue), Content-Length and chunked
bodies, ``Expect: 100-continue``, chunked streaming responses with write flow
control, and client disconnects (the worker task is cancelled, so a handler's
``finally`` runs: that is where it aborts its engine requests).

One client must never stall anyone else, so every wait on a client has a limit
(``HttpConfig``); a refused request gets its OpenAI-shaped error in its turn
among the pipelined ones, then the connection closes:

- ``max_connections`` per process (WebSockets handed over count too; a TLS one
  from its accept, ``frontends.tls``): one more closes the connection that has
  waited longest for a request, a second or more (idle, or its head or its TLS
  handshake begun and not finished: a slowloris), or else gets an immediate 503
  with ``retry-after: 1`` (over TLS, a close before the handshake);
- ``header_timeout`` from a request's first byte to the end of its head, even
  while earlier pipelined requests are being answered: 408 (an idle keep-alive
  connection past ``keep_alive_timeout`` is just closed);
- ``max_header_bytes`` for the request line and headers: 431, checked as the
  bytes arrive, so at most one read more than that is ever buffered;
- ``body_timeout``: no body bytes for that long, or a body slower than
  ``min_body_rate`` bytes a second past its first ``body_timeout`` (Apache's
  ``MinRate``: a byte now and then must not hold a connection for ever; its deadline
  moves on by a second for each ``min_body_rate`` bytes, but never more than
  ``body_timeout`` past the last bytes, so a body sent at once cannot then trickle
  for hours): 408;
  ``max_body_bytes``: 413; ``max_receiving_bytes``, the bodies of every connection
  still coming, at once: past it the bodies coming slowest (under ``EVICT_RATE``
  lately), each for ``EVICT_AFTER`` or more, get 503 and make room, else the body
  that would cross it does (a thousand slow uploads may not pin a frontend's memory,
  but this much, and not for good; uploads under way at a usable rate are kept);
- an ``Expect`` other than ``100-continue``: 417;
- ``write_timeout``: a client that reads nothing of a response (an SSE stream
  above all) for that long, while the transport is full, is cut off.

Every request gets an id (``Request.id``, sent back as ``x-request-id``; a
handler may replace it with its own, as the API does with a completion's id)
and, once answered however it ended, goes to the server's ``observer`` with its
status (499 when the client left before an answer): the access log and the
HTTP metrics. The observer runs before the answer's last byte is sent, so a
client that has its whole answer finds it counted, whichever frontend it
scrapes. Handlers may leave what the observer should know in ``Request.meta``.

Behind a reverse proxy that is one of ``forwarded_allow_ips`` (``TrustedProxies``, uvicorn's rule), a request's
``client`` is the address its X-Forwarded-For names.

Handlers are ``async (Request) -> Response | StreamingResponse`` registered by
method and path on a ``Router`` (a path ending in ``{name}`` takes every path
under its prefix). A connection can be handed to another protocol
object (WebSocket) through ``Router.add_upgrade``: the handler returns an
``Upgrade`` and the transport is switched over after the head it carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import math
import os
import socket
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import httptools
import orjson

from frontends.errors import ApiError, status_error_body

log = logging.getLogger("tokenmill.http")

_MAX_PIPELINED = 32  # queued requests per connection before we stop reading from it
TLS_GOODBYE_S = 1.0  # at shutdown, how long closed TLS connections get to send their last bytes
CUT_S = 1.0  # at the end of the shutdown grace, how long answers get to say they were cut
EVICT_AFTER = 1.0  # at the connection limit, a connection waiting this long for a request makes room for a new one
# (and past the body budget, a body that has come this long and lately under this many bytes a second)
EVICT_RATE = 16 << 10
_RATE_SLOTS = 8  # a body's bytes are counted in this many slots of EVICT_AFTER (``HttpProtocol.body_rate``)
RESCAN_AFTER = 0.05  # ... looked for at most this often while none is found


class Request:
    """One parsed request. ``headers`` has lower-case names (last one wins)."""

    __slots__ = ("method", "path", "query", "raw_headers", "headers", "body", "keep_alive",
                 "upgrade", "error", "expect_continue", "protocol", "_queued", "id", "started", "meta", "forwarded_for",
                 "http10")

    def __init__(self) -> None:
        self.id = ""  # given when it is served; a handler may set its own
        self.started = time.monotonic()  # its first byte (or when it was refused)
        self.meta: object = None  # what the handler wants the observer (access log) to see
        self.method = ""
        self.path = ""
        self.query = ""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.keep_alive = True
        self.upgrade = ""  # the Upgrade header, lower-case, if the client asked for one
        self.error: tuple[int, str] | None = None  # set when the request is refused before routing
        self.expect_continue = False
        self.protocol: HttpProtocol | None = None
        self._queued = False
        self.forwarded_for: str | None = None  # the client behind a trusted proxy (HttpConfig.forwarded_allow_ips)
        self.http10 = False  # an HTTP/1.0 client's: a stream is sent to it as the bytes up to the close, not chunked

    @property
    def client(self) -> str:
        """Who sent it: the host a trusted proxy named, else the connection's ("-": unknown)."""
        return self.forwarded_for or host_of(self.protocol.peer if self.protocol is not None else "-")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class StreamingResponse:
    """A chunked response; each item of ``chunks`` goes out as one HTTP chunk.

    ``on_close`` runs however the stream ends (finished, failed, client gone), even
    when ``chunks`` never started: the place to abort engine requests.
    """

    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = field(default_factory=list)
    on_close: Callable[[], None] | None = None


@dataclass
class Upgrade:
    """Hand the connection over: write ``head`` (e.g. a 101 response), then ``protocol`` owns
    the transport; bytes the client sent after the request go to its ``data_received``."""

    protocol: asyncio.Protocol
    head: bytes = b""


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]
UpgradeHandler = Callable[[Request], Awaitable[Response | Upgrade]]
Observer = Callable[[Request, int], None]  # (request, status) once it is answered

CLIENT_GONE = 499  # nginx's "client closed request": the client left before its answer


ErrorShape = tuple  # (body, status): another API's error shape (``shaped_errors``); status optional


def _answer(shape: ErrorShape | None, e: ApiError) -> Response:
    """``e`` as the response ``shape`` writes (None: OpenAI's)."""
    if shape is None:
        return Response(e.status, e.body(), headers=list(e.headers))
    body, status = (*shape, lambda e: e.status)[:2]
    return Response(status(e), orjson.dumps(body(e)), headers=list(e.headers))


def shaped_errors(handler: Handler, body: Callable[[ApiError], dict],
                  status: Callable[[ApiError], int] = lambda e: e.status) -> Handler:
    """``handler`` with its refusals written as ``body(e)`` says, with ``status(e)``: another API's error shape
    (Anthropic's, llama.cpp's, TGI's) on its routes. ``Router.add``'s ``errors`` does this, and shapes the
    refusals made before a handler runs (405, 413) too."""

    async def handle(req: Request) -> Response | StreamingResponse:
        try:
            return await handler(req)
        except ApiError as e:
            return _answer((body, status), e)
    return handle


class Router:
    """Routes by exact (method, path): unknown path 404, known path with another method 405. A HEAD request is
    answered as its GET is, without the body (RFC 9110 9.3.2: load balancers' and monitors' probes may send one).
    A path that ends in ``{name}`` (``/v1/models/{model}``) takes every path that goes on past its prefix (a name
    with '/' in it too); its handler reads the name from ``req.path``. An exact path wins over it."""

    def __init__(self) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}
        self._templates: list[tuple[str, str]] = []  # (prefix, path) of the paths that end in a {name}
        self._refusals: dict[tuple[str, str], Callable[[Request], bool]] = {}  # (method, path) -> refuses(head)
        self._upgrades: dict[str, UpgradeHandler] = {}
        self._shapes: dict[str, ErrorShape] = {}  # a path's error shape, where not OpenAI's
        self._prefix_shapes: list[tuple[str, ErrorShape]] = []  # ... and of the paths under a prefix

    def add(self, method: str, path: str, handler: Handler, errors: ErrorShape | None = None,
            refuses: Callable[[Request], bool] | None = None) -> None:
        """``errors``: (body, status) of the path's error shape (``shaped_errors``), for what its handler
        raises and for what the server refuses on that path before any handler runs (405, 413, 408).
        ``refuses(req)``: whether the handler refuses ``req`` from its head alone (a missing API key): then
        it is answered at once, its body never read."""
        if path.endswith("}") and "{" in path and (prefix := path[:path.rindex("{")]) not in dict(self._templates):
            self._templates.append((prefix, path))
            self._templates.sort(key=lambda t: -len(t[0]))  # (the longest prefix first)
        self._refusals.pop((method.upper(), path), None)  # (a route added again is the new handler's alone)
        if refuses is not None:
            self._refusals[method.upper(), path] = refuses
        if errors is not None:
            self._shapes[path] = errors
            handler = shaped_errors(handler, *errors)
        self._routes.setdefault(path, {})[method.upper()] = handler

    def route(self, path: str) -> str:
        """The route that serves ``path``: itself, or the path with a ``{name}`` that takes it (else itself)."""
        if path in self._routes:
            return path
        for prefix, template in self._templates:
            if len(path) > len(prefix) and path.startswith(prefix):
                return template
        return path

    def refuses(self, req: Request) -> bool:
        check = self._refusals.get((req.method, self.route(req.path)))
        return check is not None and check(req)

    def add_preflight(self, path: str, preflight: Callable[[Request, str], Awaitable[Response]]) -> None:
        """``OPTIONS`` on ``path``: ``preflight`` given the methods the path takes, as a 405's ``Allow`` lists them."""
        self._routes.setdefault(path, {})["OPTIONS"] = lambda req: preflight(req, ", ".join(self.allowed(path)))

    def allowed(self, path: str) -> list[str]:
        by_method = self._routes.get(self.route(path), {})
        return sorted({*by_method, *(["HEAD"] if "GET" in by_method else [])})

    def shape_prefix(self, prefix: str, errors: ErrorShape) -> None:
        """Refusals on paths under ``prefix`` that no route takes (404s) in that API's shape too."""
        self._prefix_shapes.append((prefix, errors))

    def error(self, path: str, e: ApiError) -> Response:
        """``e`` in ``path``'s error shape."""
        shape = self._shapes.get(self.route(path))
        if shape is None:
            shape = max(((p, s) for p, s in self._prefix_shapes if path.startswith(p)), key=lambda ps: len(ps[0]),
                        default=(None, None))[1]
        return _answer(shape, e)

    def add_upgrade(self, path: str, handler: UpgradeHandler) -> None:
        """``handler`` serves requests to ``path`` that carry an ``Upgrade`` header."""
        self._upgrades[path] = handler

    def upgrade_handler(self, path: str) -> UpgradeHandler | None:
        return self._upgrades.get(path)

    def resolve(self, method: str, path: str) -> Handler:
        by_method = self._routes.get(self.route(path))
        if by_method is None:
            raise ApiError(404, f"Not found: {path}")
        handler = by_method.get("GET" if method == "HEAD" and "HEAD" not in by_method else method)
        if handler is None:
            allowed = self.allowed(path)
            raise ApiError(405, f"Method {method} not allowed for {path}; allowed: {', '.join(allowed)}",
                           headers=[("allow", ", ".join(allowed))])
        return handler

    def handler_name(self, path: str) -> str:
        """``path`` if a route serves it, else "unmatched": a bounded set of names for metrics."""
        route = self.route(path)
        return route if route in self._routes or path in self._upgrades else "unmatched"


@dataclass
class HttpConfig:
    max_body_bytes: int = 8 << 20  # (--max-body-bytes)
    max_receiving_bytes: int = 1 << 30  # the bodies still coming, of every connection at once; past it: 503
    header_timeout: float = 30.0  # from a request's first byte (or the connection's start) to its headers
    body_timeout: float = 30.0  # longest pause between body bytes
    min_body_rate: float = 500.0  # bytes a second a body must keep up past its first body_timeout (408; 0: any)
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this
    write_timeout: float = 30.0  # longest a response may wait on a client that does not read
    max_header_bytes: int = 64 << 10  # request line + headers
    max_connections: int = 1024  # per frontend process, HTTP and WebSocket together
    # SO_SNDBUF per connection (WebSockets handed over keep it); None keeps the kernel's autotuning,
    # which lets a client that does not read park megabytes in the kernel before write_timeout starts
    socket_send_buffer: int | None = None
    # peers whose X-Forwarded-For names the client (uvicorn's --forwarded-allow-ips: addresses, networks, "*")
    forwarded_allow_ips: tuple[str, ...] = ("127.0.0.1",)


MAX_FORWARDED_HOPS = 32  # the X-Forwarded-For entries read, from the right


class TrustedProxies:
    """``HttpConfig.forwarded_allow_ips``, read once: which peers are proxies whose X-Forwarded-For is believed."""

    def __init__(self, entries: tuple[str, ...]) -> None:
        self.any = "*" in entries
        self.networks = []
        for entry in entries:
            if entry != "*":
                try:
                    self.networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ValueError(f"{entry!r} is no address or network") from None
        self.none = not (self.any or self.networks)

    def __contains__(self, host: str) -> bool:
        if self.any:
            return True
        try:
            addr = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return any(addr in net for net in self.networks)

    def client(self, raw_headers: list[tuple[bytes, bytes]], peer: str) -> str | None:
        """The client behind the proxies, as uvicorn reads it: where the connection's peer is a trusted proxy, the
        rightmost X-Forwarded-For entry that is not one (all are: the leftmost), the headers joined in order. None:
        no header, or a peer that is no trusted proxy (what it sent is the client's own word)."""
        if self.none or host_of(peer) not in self:  # (an untrusted peer's header costs nothing: review)
            return None
        joined = b",".join(v for k, v in raw_headers if k.lower() == b"x-forwarded-for")
        # the last hops only, split off at C's pace and read from the right until the client: a 64 KiB header of
        # hops, each parsed, cost milliseconds
        leftmost = None
        for hop in reversed(joined.rsplit(b",", MAX_FORWARDED_HOPS)[-MAX_FORWARDED_HOPS:]):
            host = _hop_host(hop)
            if host and host not in self:
                return host
            leftmost = host or leftmost
        return leftmost


def _hop_host(hop: bytes) -> str:
    """An X-Forwarded-For entry's host, an IP address: its port dropped (``1.2.3.4:80``, ``[2001:db8::1]:443``),
    so that a proxy that writes ports does not make each connection another client; "" for what is no address
    ("unknown", a name, a caller's made-up text: it names no client)."""
    h = hop.strip().decode("latin-1")
    if h.startswith("["):
        h = h[1:h.index("]")] if "]" in h else ""
    elif h.count(":") == 1:
        h = h.partition(":")[0]
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        return ""


def host_of(peer: str) -> str:
    """The host of a "host:port" peer (``peer_of``; "-": unknown)."""
    return peer.rpartition(":")[0] or "-"


def peer_of(transport) -> str:
    """``host:port`` of a connection's client ("-" when unknown)."""
    try:
        peer = transport.get_extra_info("peername") if transport is not None else None
    except AttributeError:  # (uvloop's, asked once a reset has closed the connection: its socket is gone)
        peer = None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "-"


def _field_list(raw_headers: list[tuple[bytes, bytes]], name: bytes) -> list[str]:
    """A list field's items, every line of it as one list (RFC 9110 5.3), in order, lower-cased: ``Expect``'s
    expectations, ``Transfer-Encoding``'s codings (RFC 9112 6.1)."""
    values = b",".join(v for k, v in raw_headers if k.lower() == name).decode("latin-1").lower()
    return [item.strip() for item in values.split(",") if item.strip()]


def _path(url) -> str:
    """A parsed request target's path ("/" for none)."""
    return url.path.decode("utf-8", "replace") if url.path else "/"


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\n".encode()


_STATUS_LINES: dict[int, bytes] = {}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _head(status: int, content_type: str, headers: list[tuple[str, str]], keep_alive: bool,
          length: int | None, chunked: bool = True) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = _status_line(status)
    parts = [line, b"content-type: ", content_type.encode(), b"\r\n"] if status != 204 else [line]
    if length is None:
        parts.append(b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n" if chunked else b"cache-control: no-cache\r\n")
    elif status != 204:  # a 204 has no body, so no length either (RFC 9110 8.6)
        parts += [b"content-length: ", str(length).encode(), b"\r\n"]
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    for k, v in headers:
        parts += [k.encode(), b": ", v.encode("latin-1"), b"\r\n"]
    parts.append(b"\r\n")
    return b"".join(parts)


class HttpServer:
    """The shared state of every connection: routes, limits, and the live connections."""

    def __init__(self, router: Router, config: HttpConfig | None = None, observer: Observer | None = None) -> None:
        self.router = router
        self.config = config or HttpConfig()
        self.trusted = TrustedProxies(self.config.forwarded_allow_ips)
        self.observer = observer
        self._id_prefix = f"req-{os.urandom(4).hex()}"
        self._ids = itertools.count()
        self.connections: set[HttpProtocol] = set()  # and the WebSocket connections handed over
        self.receiving = 0  # bytes of request bodies still coming, of every connection (max_receiving_bytes)
        self.shutting_down = False
        self._full_since = -1e9  # when "connection limit reached" was last logged
        self._no_room_until = -1e9  # (time.monotonic) until when no connection is looked for to make room
        self._no_body_room_until = -1e9  # (loop time) ... no body is looked for to make room (``made_body_room``)

    def __call__(self) -> HttpProtocol:  # the protocol factory for loop.create_server
        return HttpProtocol(self)

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):x}"

    def observe(self, req: Request, status: int) -> None:
        if self.observer is not None:
            try:
                self.observer(req, status)
            except Exception:  # noqa: BLE001 - a logging or metrics bug must not cost the answer
                log.exception("request observer failed for %s", req.id)

    def at_capacity(self) -> bool:
        if len(self.connections) < self.config.max_connections or self._made_room():
            return False
        now = time.monotonic()
        if now - self._full_since > 10.0:  # one line per burst, not one per refused connection
            self._full_since = now
            log.warning("connection limit reached (%d): new connections get 503", self.config.max_connections)
        return True

    def _made_room(self) -> bool:
        """At the limit, the connection that has waited longest for a request, if ``EVICT_AFTER`` seconds or more
        (idle since it was made or since its last answer, or its head begun and not finished: a slowloris), is
        closed to let a new one in; connections with a request under way are kept. (A scan that finds none is the
        last for ``RESCAN_AFTER`` seconds: a flood of connections at the limit costs a 503 each, not a scan each.)"""
        now = time.monotonic()
        if now < self._no_room_until:
            return False
        waiting = [c for c in self.connections if isinstance(c, HttpProtocol) and c.waiting_since <= now - EVICT_AFTER]
        if not waiting:
            self._no_room_until = now + RESCAN_AFTER
            return False
        oldest = min(waiting, key=lambda c: c.waiting_since)
        self.connections.discard(oldest)
        oldest.close()
        return True

    def made_body_room(self, n: int, asker: HttpProtocol) -> bool:
        """Past ``max_receiving_bytes``, ``n`` more body bytes for ``asker``: the bodies coming slowest, lately under
        ``EVICT_RATE`` (a trickle holding its bytes; an upload under way at a usable rate is kept: review X), each
        for ``EVICT_AFTER`` seconds or more, get 503 one at a time until they fit; none if that cannot be enough
        (False; a scan that frees nothing is the last for ``RESCAN_AFTER``)."""
        c = self.config
        now = asker._loop.time()
        if now < self._no_body_room_until:
            return False
        rated = [(p.body_rate(now), id(p), p) for p in self.connections if isinstance(p, HttpProtocol)
                 and p._receiving and p is not asker and p._body_began <= now - EVICT_AFTER]
        slow = [p for rate, _, p in sorted(rated) if rate < EVICT_RATE]
        if self.receiving + n - sum(p._receiving for p in slow) > c.max_receiving_bytes:
            self._no_body_room_until = now + RESCAN_AFTER
            return False
        for p in slow:
            if self.receiving + n <= c.max_receiving_bytes:
                break
            p._refuse(p._cur, 503, f"Too many request bodies coming at once (limit {c.max_receiving_bytes} bytes): "
                                   f"this one, coming slowest, gave way; retry shortly")
        return True

    async def shutdown(self, grace: float, cut: Callable[[], None] | None = None) -> None:
        """Close idle connections now, let busy ones finish within ``grace`` seconds, then cut them: ``cut``
        first ends what they wait for (the engine requests still running, each as an error its stream can
        say), and they get ``CUT_S`` more to say it."""
        self.shutting_down = True
        for conn in list(self.connections):
            if conn.idle:
                conn.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if not await self._paid_by(deadline) and cut is not None:
            cut()
            deadline = loop.time() + CUT_S
            await self._paid_by(deadline)
        for conn in list(self.connections):
            if _owed(conn):
                conn.abort()
            else:
                conn.close()
        # A TLS connection's last encrypted bytes may still wait in the socket's own transport, which its write
        # buffer size does not count: a moment more for them to leave (not the grace: an idle client never
        # answers the goodbye that keeps the connection open)
        goodbye = min(deadline, loop.time() + TLS_GOODBYE_S)
        while self.connections and loop.time() < goodbye:
            await asyncio.sleep(0.05)


    async def _paid_by(self, deadline: float) -> bool:
        """Whether every connection was owed nothing more by ``deadline`` (loop time), waiting until then."""
        loop = asyncio.get_running_loop()
        # (not until every connection is gone: a closed TLS one waits for the client's close_notify, which an
        # idle keep-alive client never sends; the whole grace went by for each such client)
        while any(_owed(conn) for conn in self.connections):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def _owed(conn) -> bool:
    """A connection (HTTP or WebSocket) with a request in flight, or bytes of an answer not yet handed to the
    kernel."""
    return not conn.idle or (conn.transport is not None and conn.transport.get_write_buffer_size() > 0)


class _StopParsing(Exception):
    """Raised in a parser callback once the request is refused: httptools stops mid-read."""


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.config = server.config
        self.transport: asyncio.Transport | None = None
        self.peer = "-"  # the client's host:port, as it connected (one that reset has none to give by then)
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cur: Request | None = None  # the request being parsed
        self._url = bytearray()
        self._pending: deque[Request] = deque()
        self._worker: asyncio.Task | None = None
        self._responding = False
        self._stop_reading = False  # after an unrecoverable request (4xx from this layer, upgrade)
        self._leftover = b""  # bytes after an upgrade request
        self._ignored: bytes | None = None  # the head of a request whose Upgrade nobody takes, to read again
        self._timer: asyncio.TimerHandle | None = None
        self._write_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self._reading_paused = False
        self._messages = 0  # requests begun on this connection
        self._in_head = False  # from a request's first byte to the end of its headers
        self._head_bytes = 0  # of that head: the request target and the headers parsed so far
        self._head_raw = 0  # of that head: the reads known to hold nothing else
        self._last_body = 0.0  # loop time of the current request's last body bytes
        self._body_began = 0.0  # ... and of when its body was first due
        self._body_slots: deque[list[int]] = deque()  # its bytes lately: [slot (``_RATE_SLOTS``), bytes] each
        self._body_due = 0.0  # ... and of when its body is too slow (min_body_rate), moved on by its bytes
        self._paused_at = 0.0  # loop time of the last pause_reading (too many pipelined requests)
        self._receiving = 0  # of the server's ``receiving``: the current request's body bytes so far
        self._idle_since = math.inf  # (time.monotonic) when it began to wait for a request: ``waiting_since``

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is None and not self.accept(transport):  # (TLS: counted at its accept, ``frontends.tls``)
            return
        self.transport = transport  # type: ignore[assignment]

    def accept(self, transport: asyncio.BaseTransport, tls: bool = False) -> bool:
        """Counts the connection in, as waiting for a request from now; at the limit, with no room to make, it is
        answered 503 and closed (a ``tls`` one before its handshake, with nothing to say) and False returned."""
        self.transport = transport  # type: ignore[assignment]
        self.peer = peer_of(transport)
        self._loop = asyncio.get_running_loop()
        if self.server.at_capacity():
            self._stop_reading = self.lost = True  # never counted, never served
            req = Request()
            req.id, req.protocol = self.server.new_id(), self
            self.server.observe(req, 503)  # (before the answer leaves, as any answer)
            if not tls:
                body = status_error_body(503, f"Too many connections (limit {self.config.max_connections}); "
                                              "retry shortly")
                transport.write(_head(503, "application/json", [("retry-after", "1")], False, len(body)) + body)
            transport.close()
            return False
        self.server.connections.add(self)
        self._idle_since = time.monotonic()
        if self.config.socket_send_buffer and (sock := transport.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.socket_send_buffer)
        self._arm(self.config.header_timeout)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        self._received()
        self._disarm()
        self._pending.clear()
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        self._wake_writer()

    def eof_received(self) -> bool:
        # a client that closes its side has gone away (as uvicorn treats it): the transport
        # closes, connection_lost cancels the handler, and its engine requests are aborted
        return False

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        pending = [data]
        while pending and not self._stop_reading:  # (more than one: an Upgrade nobody takes, read again)
            pending[:1] = self._feed(pending[0])

    def _feed(self, data: bytes | memoryview) -> list:
        """``data`` parsed; what is left to parse: a request whose Upgrade nobody takes, its head again (without
        it) and the bytes after its head, which llhttp left unread (``_ignore_upgrade``), or nothing."""
        began, between = self._messages, self._cur is None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            rest = memoryview(data)[e.args[0]:] if e.args else b""  # (not copied: many such requests may follow)
            if self._ignored is None:
                self._leftover = bytes(rest)
                self._stop_reading = True
                return []
            head, self._ignored = self._ignored, None
            self.parser = httptools.HttpRequestParser(self)
            return [head, rest]
        except httptools.HttpParserError as e:
            if not self._stop_reading:  # (else a callback refused the request and stopped the parser)
                req = self._cur if self._cur is not None and not self._cur._queued else Request()
                self._refuse(req, 400, f"Malformed HTTP request: {e}")
            return []
        if self._in_head:
            # httptools buffers a header until it is complete, unseen by on_header: count the
            # reads that can only be head, i.e. all of them from the one where the head started
            if self._messages == began:
                self._head_raw += len(data)
            elif self._messages == began + 1 and between:
                self._head_raw = len(data)
            if self._head_raw > self.config.max_header_bytes:
                self._refuse(self._cur, 431, self._head_message())
        return []

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        self._cur = Request()  # (its clock starts now)
        self._cur.protocol = self
        self._idle_since = time.monotonic()  # (at the connection limit, a head is timed from its first byte)
        self._url.clear()
        self._messages += 1
        self._in_head = True
        self._head_bytes = self._head_raw = 0
        self._arm(self.config.header_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._cur.raw_headers.append((name, value))  # type: ignore[union-attr]
        self._count_head(len(name) + len(value) + 4)

    def on_headers_complete(self) -> None:
        self._in_head = False
        req = self._cur
        assert req is not None
        req.method = self.parser.get_method().decode()
        try:
            url = httptools.parse_url(bytes(self._url))
        except httptools.HttpParserInvalidURLError:  # (llhttp said "User callback error": review AB)
            self._refuse(req, *((405, "CONNECT is not supported: this server is no proxy") if req.method == "CONNECT"
                                else (400, "Malformed request target")))
            raise _StopParsing from None
        req.path = _path(url)
        req.query = url.query.decode("utf-8", "replace") if url.query else ""
        req.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in req.raw_headers}
        if "x-forwarded-for" in req.headers:
            req.forwarded_for = self.server.trusted.client(req.raw_headers, self.peer)
        req.keep_alive = self.parser.should_keep_alive() and not self.server.shutting_down
        req.http10 = self.parser.get_http_version() == "1.0"
        hosts = sum(k.lower() == b"host" for k, _ in req.raw_headers)
        if hosts > 1 or (hosts == 0 and not req.http10):  # (RFC 9112 3.2: which names the server, a guess)
            self._refuse(req, 400, "A request takes one Host header" if hosts else
                         "An HTTP/1.1 request takes a Host header")
            raise _StopParsing
        if self.parser.should_upgrade():
            req.upgrade = req.headers.get("upgrade", "").lower()
        length = req.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            self._too_large(req)
        expect = "expect" in req.headers and set(_field_list(req.raw_headers, b"expect"))
        if expect and expect != {"100-continue"}:  # (RFC 9110 10.1.1: one it cannot meet)
            self._refuse(req, 417, f"Expectation not supported: {', '.join(sorted(expect))} (only 100-continue)")
            raise _StopParsing
        has_body = length is not None or "transfer-encoding" in req.headers
        codings = _field_list(req.raw_headers, b"transfer-encoding") if "transfer-encoding" in req.headers else None
        if codings is not None and codings != ["chunked"]:
            # (llhttp reads "gzip, chunked" as chunked: the body would be taken as it came, still compressed)
            self._refuse(req, 501, f"Transfer-Encoding {', '.join(codings)} is not supported (only chunked)")
            raise _StopParsing
        if has_body and self.server.router.refuses(req):  # (no API key: its handler answers without its body)
            self._answer_now(req)
            raise _StopParsing
        if has_body:  # time it
            self._start_body_clock()
            self._arm(self.config.body_timeout)
        else:
            self._disarm()
        # a body to wait for, from an HTTP/1.1 client (one of HTTP/1.0 is to be ignored: it may not know a 100)
        if expect and has_body and not req.http10:
            if self._responding or self._pending:
                req.expect_continue = True  # sent when the responses ahead of it are written
            else:
                self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        req = self._cur
        if req is None or req._queued:
            return
        server, c, n = self.server, self.config, len(body)
        if len(req.body) + n > c.max_body_bytes:  # (first: a body refused anyway makes no room, review X)
            self._too_large(req)
        if server.receiving + n > c.max_receiving_bytes and not server.made_body_room(n, self):
            self._refuse(req, 503, f"Too many request bodies coming at once (limit {c.max_receiving_bytes} bytes); "
                                   "retry shortly")
            raise _StopParsing
        if req.expect_continue:  # sent without waiting for its 100 (held behind an answer): none is owed now
            req.expect_continue = False  # (RFC 9110 10.1.1), and the body is timed from its first bytes on
            self._start_body_clock()
        server.receiving += n
        self._receiving += n
        req.body += body
        now = self._last_body = self._loop.time()
        slots, slot = self._body_slots, int(now * _RATE_SLOTS / EVICT_AFTER)
        if slots and slots[-1][0] == slot:
            slots[-1][1] += n
        else:
            slots.append([slot, n])
            if len(slots) > _RATE_SLOTS:
                slots.popleft()
        if c.min_body_rate:  # (a second for each min_body_rate bytes, banked up to body_timeout ahead)
            self._body_due = min(self._body_due + n / c.min_body_rate, self._last_body + c.body_timeout)

    def body_rate(self, now: float) -> float:
        """The current body's bytes a second over the last ``EVICT_AFTER`` (to one of its ``_RATE_SLOTS``)."""
        slot = int(now * _RATE_SLOTS / EVICT_AFTER)
        return sum(n for s, n in self._body_slots if s > slot - _RATE_SLOTS) / EVICT_AFTER

    def on_message_complete(self) -> None:
        self._received()
        req = self._cur
        if req is not None and not req._queued and self.parser.should_upgrade() and self._ignore_upgrade(req):
            self._cur = None
            return
        if req is not None and not req._queued:
            self._disarm()
            self._enqueue(req)
        self._cur = None

    def _ignore_upgrade(self, req: Request) -> bool:
        """An Upgrade no route takes is ignored (RFC 9110 7.8; ``curl --http2`` asks for h2c): ``req``'s head is
        kept, without it, to be read again (``data_received``) with the body the parser left unread. Never longer
        than it came (its header limit holds), and never where the parser read a body (it would be read twice)."""
        if self.server.router.upgrade_handler(req.path) is not None or req.method == "CONNECT" or req.body:
            return False
        drop = {b"upgrade", b"http2-settings"} | (set() if req.expect_continue else {b"expect"})  # (a 100 sent: once)
        lines = [f"{req.method} ".encode() + bytes(self._url) + f" HTTP/{self.parser.get_http_version()}".encode()]
        for name, value in req.raw_headers:
            key = name.lower()
            if key == b"connection":
                value = b",".join(t for t in (t.strip() for t in value.split(b",")) if t.lower() not in drop)
                if not value:
                    continue
            elif key in drop:
                continue
            lines.append(name + b":" + value)
        self._ignored = b"\r\n".join(lines) + b"\r\n\r\n"
        return True

    # ------------------------------------------------------------------ refusals

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.config.max_header_bytes:
            self._refuse(self._cur, 431, self._head_message())
            raise _StopParsing

    def _head_message(self) -> str:
        return f"Request line and headers too large (limit {self.config.max_header_bytes} bytes)"

    def _too_large(self, req: Request) -> None:
        self._refuse(req, 413, f"Request body too large (limit {self.config.max_body_bytes} bytes: the server's "
                               "--max-body-bytes)")
        raise _StopParsing

    def _refuse(self, req: Request, status: int, message: str) -> None:
        """Answer ``req`` with an error in its turn, then close: nothing more is read."""
        req.error = (status, message)
        if self._in_head and self._url:  # (its path, for the error's shape, as far as it came)
            try:
                req.path = _path(httptools.parse_url(bytes(self._url)))
            except httptools.HttpParserInvalidURLError:
                pass
        self._answer_now(req)

    def _answer_now(self, req: Request) -> None:
        """``req`` answered in its turn as it stands, without (the rest of) its body, then the close: nothing
        more is read."""
        self._received()
        req.body = bytearray()
        req.keep_alive = False
        self._in_head = False
        self._disarm()
        self._enqueue(req)
        self._stop_reading = True

    def _start_body_clock(self) -> None:
        """The current request's body is due from now: its first ``body_timeout`` free (``_on_timeout``)."""
        self._last_body = self._body_began = self._loop.time()
        self._body_slots.clear()
        self._body_due = self._last_body + self.config.body_timeout

    def _received(self) -> None:
        """The current request's body is no longer coming (complete, refused, or its connection lost)."""
        self.server.receiving -= self._receiving
        self._receiving = 0

    # ------------------------------------------------------------------ request queue

    def _enqueue(self, req: Request) -> None:
        req._queued = True
        req.protocol = self
        self._pending.append(req)
        if len(self._pending) >= _MAX_PIPELINED and not self._reading_paused:
            self._reading_paused = True
            self._paused_at = self._loop.time()
            self.transport.pause_reading()
        if self._worker is None or self._worker.done():
            self._worker = self._loop.create_task(self._work())

    async def _work(self) -> None:
        while self._pending and not self.lost:
            req = self._pending.popleft()
            if self._reading_paused and len(self._pending) < _MAX_PIPELINED // 2:
                self._reading_paused = False
                paused = self._loop.time() - self._paused_at  # (a body's clocks stood still meanwhile)
                self._last_body += paused
                self._body_due += paused
                self._body_began += paused
                self.transport.resume_reading()
            self._responding = True
            try:
                if await self._serve(req):
                    return  # the connection now belongs to another protocol
            finally:
                self._responding = False
            if not req.keep_alive:
                self.close()
                return
            cur = self._cur
            if cur is not None and cur.expect_continue and not self._pending:
                cur.expect_continue = False
                self._start_body_clock()  # (it was not to send its body before the 100)
                self.transport.write(_CONTINUE)
        if self.lost:
            return
        if self.server.shutting_down or self._stop_reading:
            self.close()
            return
        self._idle_since = time.monotonic()
        if self._cur is None:
            self._arm(self.config.keep_alive_timeout)

    async def _serve(self, req: Request) -> bool:
        """Answer one request; True when the connection was handed to another protocol."""
        req.id = self.server.new_id()
        status = CLIENT_GONE  # until an answer goes out
        try:
            if req.error is not None:
                code, msg = req.error
                req.keep_alive = False
                self.server.observe(req, code)  # before the answer leaves, as any answer (review AB's count: a race)
                status = None
                self._send(req, self.server.router.error(req.path, ApiError(code, msg)))
                return False
            try:
                if req.upgrade and (up := self.server.router.upgrade_handler(req.path)) is not None:
                    req.keep_alive = False  # refused: said so (the parser stopped at the upgrade: the connection ends)
                    result = await up(req)
                    if isinstance(result, Upgrade):
                        status = 101
                        self._hand_over(result)
                        return True
                else:
                    if self._leftover or self._stop_reading and (req.upgrade or req.method == "CONNECT"):
                        req.keep_alive = False  # the parser stopped at an upgrade nobody took (a CONNECT is one)
                    result = await self.server.router.resolve(req.method, req.path)(req)
            except ApiError as e:  # (404 or 405: in the path's shape)
                result = self.server.router.error(req.path, e)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a handler bug must not take the connection's other requests down
                log.exception("handler failed: %s %s (request %s)", req.method, req.path, req.id)
                result = Response(500, status_error_body(500, "Internal server error"))
            if not self.lost:
                status = result.status
            if isinstance(result, StreamingResponse):
                await self._stream(req, result, status)  # observes it before its last chunk
                status = None
            else:
                self.server.observe(req, status)  # before the answer leaves: see ``_stream``
                status = None
                self._send(req, result)
                if self._write_paused:
                    await self.drain()
            return False
        finally:
            if status is not None:
                self.server.observe(req, status)

    def _send(self, req: Request, resp: Response) -> None:
        if self.lost:
            return
        headers = [*resp.headers, ("x-request-id", req.id)]
        self.transport.write(_head(resp.status, resp.content_type, headers, req.keep_alive,
                                   len(resp.body)) + (resp.body if req.method != "HEAD" else b""))

    async def _stream(self, req: Request, resp: StreamingResponse, status: int) -> None:
        """Send ``resp`` in chunks; observe it once it has ended, before its last chunk goes out.

        Observing first (a plain answer too) means a client that has its whole answer
        finds it in ``/metrics``, whichever frontend serves the scrape.
        """
        write = self.transport.write
        cut, chunked = False, not req.http10  # (RFC 9112 6.1: no transfer coding for HTTP/1.0; the close ends it)
        if not chunked:
            req.keep_alive = False
        write(_head(resp.status, resp.content_type, [*resp.headers, ("x-request-id", req.id)], req.keep_alive,
                    None, chunked))
        chunks = resp.chunks
        try:
            async for chunk in chunks:
                if self.lost or req.method == "HEAD":  # (a HEAD request's answer: the head alone)
                    break
                if chunk:
                    write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                    if self._write_paused:
                        await self.drain()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the head is out: all we can do is cut the stream
            log.exception("stream failed: %s %s (request %s)", req.method, req.path, req.id)
            req.keep_alive = False
            self.abort()
            cut = True
        finally:
            if resp.on_close is not None:
                resp.on_close()
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        self.server.observe(req, status)
        if chunked and not (cut or self.lost or req.method == "HEAD"):
            write(b"0\r\n\r\n")

    def _hand_over(self, up: Upgrade) -> None:
        transport = self.transport
        self._disarm()
        self.server.connections.discard(self)
        self.lost = True  # for this object; the new protocol owns the transport from here
        if up.head:
            transport.write(up.head)
        transport.set_protocol(up.protocol)
        up.protocol.connection_made(transport)
        if self._reading_paused:
            transport.resume_reading()
        if self._leftover:
            up.protocol.data_received(self._leftover)

    # ------------------------------------------------------------------ flow control, timers, close

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its high-water mark (or the client left).

        A client that reads nothing for ``write_timeout`` seconds is cut off: the connection is
        aborted and the worker cancelled, so the handler's ``finally`` (or ``on_close``) runs.
        """
        if not self._write_paused or self.lost:
            return
        loop = self._loop
        deadline = loop.time() + self.config.write_timeout
        while self._write_paused and not self.lost:
            left = deadline - loop.time()
            if left <= 0:
                log.info("client read nothing for %gs: connection cut", self.config.write_timeout)
                self._reset()
                raise asyncio.CancelledError
            self._drain_waiter = loop.create_future()
            timer = loop.call_later(left, self._wake_writer)
            try:
                await self._drain_waiter
            finally:
                timer.cancel()

    def _wake_writer(self) -> None:
        w, self._drain_waiter = self._drain_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def idle(self) -> bool:
        return (self._worker is None or self._worker.done()) and not self._pending

    @property
    def waiting_since(self) -> float:
        """Since when (``time.monotonic``) it has waited for a request's head, or infinity: a request is under way
        (its body coming, or answered) or the connection is another protocol's now."""
        if self.lost or not self.idle or self._cur is not None and not self._in_head or (
                self.transport is not None and self.transport.get_write_buffer_size()):  # (its last answer still going)
            return math.inf
        return self._idle_since

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self._loop.call_later(seconds, self._on_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timeout(self) -> None:
        self._timer = None
        req = self._cur
        if req is None or req._queued:  # between requests
            if self.idle:
                self.close()  # (a busy worker arms the keep-alive timer when it is done)
            return
        c = self.config
        if self._reading_paused or req.expect_continue:  # we are the ones not reading: wait on
            self._arm(c.header_timeout if self._in_head else c.body_timeout)
        elif self._in_head:
            self._refuse(req, 408, f"Request headers not received within {c.header_timeout:g}s")
        elif (idle := self._loop.time() - self._last_body) >= c.body_timeout:
            self._refuse(req, 408, f"No request body bytes for {c.body_timeout:g}s")
        else:
            left = c.body_timeout - idle
            if c.min_body_rate:  # (the body's deadline moves on as its bytes come: on_body)
                due = self._body_due - self._loop.time()
                if due <= 0:
                    self._refuse(req, 408, f"Request body too slow: under {c.min_body_rate:g} bytes a second "
                                           f"after the first {c.body_timeout:g}s")
                    return
                left = min(left, due)
            self._arm(left)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # (it goes once what is written has been sent: see ``_cut_if_stuck``)
            if self.transport.get_write_buffer_size():
                self._loop.call_later(self.config.write_timeout, self._cut_if_stuck, math.inf)

    def _cut_if_stuck(self, left: float) -> None:
        """A closed connection whose client reads nothing of what is left to send for ``write_timeout`` seconds is
        reset, as a stream's is: it would stay open (out of the connection count) for as long as the client likes."""
        now_left = 0 if self.lost or self.transport is None else self.transport.get_write_buffer_size()
        if now_left and now_left >= left:
            self._reset()
        elif now_left:
            self._loop.call_later(self.config.write_timeout, self._cut_if_stuck, now_left)

    def abort(self) -> None:
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        if self.transport is not None:
            self.transport.abort()

    def _reset(self) -> None:
        """Abort with a TCP reset: the megabytes the client did not read are dropped now, not left
        for the kernel to trickle into a zero window for minutes."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.abort()
