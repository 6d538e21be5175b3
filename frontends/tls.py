"""TLS connections counted from their TCP accept, not from the end of their handshake.

``create_server(ssl=...)`` (asyncio's and uvloop's) calls a protocol's ``connection_made`` only once
the handshake is done, and tells it nothing of one that fails, so a client that opened connections
and never finished a handshake held sockets outside ``--max-connections``, each for up to
``--header-timeout``. Here the server listens in plain TCP and each connection's protocol is the
loop's own TLS layer, wrapped (``TlsConnection``): the HTTP connection is counted at the accept, as
waiting for a request since then (at the limit a stalled handshake makes room as an idle
connection does, and one more connection while none can is closed before its handshake), and
leaves the count when its socket closes, handshake done or not. The handshake and the wait for a
first request share one ``--header-timeout``.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import functools
import ssl
from collections.abc import Callable

from frontends.http import HttpProtocol, HttpServer


class TlsConnection(asyncio.BufferedProtocol):
    """The TLS layer between one socket and its ``HttpProtocol``."""

    def __init__(self, server: HttpServer, context: ssl.SSLContext, layer: type) -> None:
        self.http = HttpProtocol(server)
        self.raw: asyncio.BaseTransport | None = None
        self.tls = layer(asyncio.get_running_loop(), self.http, context, None, server_side=True,
                         ssl_handshake_timeout=server.config.header_timeout)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.raw = transport
        if self.http.accept(transport, tls=True):  # (else closed, at the limit: no handshake)
            self.tls.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.http.transport is self.raw:  # the handshake never ended: the TLS layer tells the HTTP one nothing
            self.http.connection_lost(exc)
        self.tls.connection_lost(exc)

    def get_buffer(self, sizehint: int):
        return self.tls.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.tls.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return self.tls.eof_received()

    def pause_writing(self) -> None:
        self.tls.pause_writing()

    def resume_writing(self) -> None:
        self.tls.resume_writing()


def protocol(server: HttpServer, context: ssl.SSLContext | None) -> Callable[[], asyncio.BaseProtocol]:
    """``loop.create_server``'s protocol factory (in the loop that serves): ``server``'s connections, in TLS where a
    ``context`` is given."""
    return server if context is None else functools.partial(TlsConnection, server, context,
                                                            _layer(asyncio.get_running_loop()))


def _layer(loop: asyncio.AbstractEventLoop) -> type:
    """The loop's own TLS protocol: uvloop's (its transports, in C) or asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.sslproto.SSLProtocol
    return uvloop.loop.SSLProtocol if isinstance(loop, uvloop.Loop) else asyncio.sslproto.SSLProtocol
