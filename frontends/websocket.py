"""WebSocket token streaming at ``GET /v1/stream``.

RFC 6455 framing, the opening handshake and permessage-deflate come from the
``websockets`` package's sans-I/O ``ServerProtocol``; this module owns the
asyncio side: the HTTP server hands the transport over after the 101, and a
``Connection`` feeds it bytes, writes what the protocol wants sent, and runs
the generations.

One connection carries many generations, each named by a client-chosen ``id``::

    -> {"type": "completion", "id": "a", "prompt": "...", ...}   # /v1/completions fields
    -> {"type": "chat", "id": "b", "messages": [...], ...}       # /v1/chat/completions fields
    -> {"type": "cancel", "id": "a"}
    -> {"type": "stats"}                                        # the engine's queue and KV use
    <- {"type": "delta", "id": "a", "text": "...", "token_ids": [...], "logprobs": ...}
    <- {"type": "done", "id": "a", "finish_reason": "length", "usage": {...}}
       (a chat with tools or thinking: and "message", the content, reasoning and tool calls read out of the text)
    <- {"type": "error", "id": "a", "error": {"message", "type", "param", "code"}}

Bodies are checked by the same code as the HTTP API (``OpenAIApi.completion_job``
/ ``chat_job``), so the same request gives the same tokens and the same errors;
only ``n`` = 1 and one prompt per message. ``done``'s usage is HTTP's, prefix-cache
hits (``prompt_tokens_details.cached_tokens``) included. Their ``priority``,
``timeout`` and ``cache_salt`` work as over HTTP, except that a generation that
reaches its deadline always ends with a ``done`` whose finish_reason is
"timeout", even before its first token (HTTP answers that case with a 408), and
one the engine could not run (out of memory) ends with an ``error`` (500). An
error worth retrying later (the engine's queue is full: 429) carries
``"retry_after": <seconds>`` beside ``error``, as HTTP sends a Retry-After header
beside the body. A cancel (or the socket closing) aborts the engine request at
once. The client is never waited for: what it has not read piles up in the
transport, and past ``max_buffered_bytes`` the connection is closed with 1008
and its generations aborted, so a stalled reader costs neither the engine nor
other clients anything. Nor does a flood: stats messages share one engine round
trip per connection, and past ``max_frames_per_second`` (a token bucket) the
socket is closed with 1008.

Auth: the HTTP API's keys, from ``Authorization: Bearer`` or, for browsers, a
``Sec-WebSocket-Protocol`` value ``tokenmill.key.<KEY>`` (offer ``tokenmill.v1``
with it: that is the one echoed back, so the key never is; a key offered alone
is a 400, and so are two keys or more). Without keys, a
browser page from an origin that is neither ours nor in ``--allowed-origins`` is
refused (403): a WebSocket is not bound by the same-origin policy, and any site
could otherwise drive the server (the rule lives in ``frontends.auth``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from dataclasses import dataclass

import orjson
from websockets.datastructures import Headers
from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
from websockets.frames import Frame, Opcode
from websockets.http11 import Request as WsRequest
from websockets.protocol import State
from websockets.server import ServerProtocol

from frontends import chat_page
from frontends import openai_params as op
from frontends.access_log import AccessLog
from frontends.errors import ApiError, status_error_body
from frontends.generation import Generation, usage_dict
from frontends.http import HttpServer, Request, Response, Router, Upgrade, peer_of
from frontends.openai_api import OpenAIApi, stats_fields

log = logging.getLogger("tokenmill.websocket")
_wire_log = logging.getLogger("tokenmill.websocket.wire")  # the protocol layer's own log: a line per connection
if _wire_log.level == logging.NOTSET:
    _wire_log.setLevel(logging.WARNING)

PATH = "/v1/stream"
SUBPROTOCOL = "tokenmill.v1"
KEY_PREFIX = "tokenmill.key."
# the key as base64url of its UTF-8, unpadded: a subprotocol is a token of plain characters, and a key made by
# `openssl rand -base64` holds "/", "+" and "=" (the chat page sends its key this way)
KEY64_PREFIX = "tokenmill.key64."

# close codes (RFC 6455 section 7.4)
NORMAL, GOING_AWAY, BAD_DATA, POLICY, INTERNAL = 1000, 1001, 1007, 1008, 1011


@dataclass(frozen=True)
class WsConfig:
    max_message_bytes: int = 1 << 20  # a bigger incoming message closes the socket with 1009
    max_buffered_bytes: int = 4 << 20  # unsent bytes before a client that does not read is cut off (1008)
    max_generations: int = 256  # live generations on one connection; more get a 429 error
    max_id_length: int = 256
    max_pending_stats: int = 16  # stats messages waiting for one engine round trip; more get a 429 error
    max_frames_per_second: int = 1000  # sustained, with as many in a burst; beyond it the socket closes 1008
    ping_interval: float = 20.0
    ping_timeout: float = 20.0  # no pong within this after a ping: close 1011
    idle_timeout: float = 300.0  # no generation and no message for this long: close 1000
    close_timeout: float = 5.0  # after our close frame, how long the client gets before the TCP cut
    compression: bool = True  # permessage-deflate, when the client offers it


def register(router: Router, api: OpenAIApi, config: WsConfig | None = None,
             access_log: AccessLog | None = None) -> WebSocketEndpoint:
    """Add ``/v1/stream`` (upgrade, and a 426 for plain GETs) and the chat page at ``/``.

    ``access_log``: where each generation's line goes when it ends."""
    ep = WebSocketEndpoint(api, config or WsConfig(), access_log)
    router.add_upgrade(PATH, ep.upgrade)
    router.add("GET", PATH, ep.not_upgraded)
    chat_page.register(router, api)  # the page is this endpoint's client
    return ep


class WebSocketEndpoint:
    """The handshake (auth, origin, negotiation); one per frontend process."""

    def __init__(self, api: OpenAIApi, config: WsConfig, access_log: AccessLog | None = None) -> None:
        self.api = api
        self.config = config
        self.access_log = access_log
        self.connections: set[Connection] = set()

    async def not_upgraded(self, req: Request) -> Response:
        return Response(426, status_error_body(426, f"{PATH} is a WebSocket endpoint: send an Upgrade request"),
                        headers=[("upgrade", "websocket")])

    async def upgrade(self, req: Request) -> Response | Upgrade:
        offered = _offered_subprotocols(req)
        tokens = self._check_auth(req, offered)
        if SUBPROTOCOL not in offered and any(p.startswith((KEY_PREFIX, KEY64_PREFIX)) for p in offered):
            raise ApiError(400, f"offer the subprotocol '{SUBPROTOCOL}' beside '{KEY_PREFIX}<key>': it is the one "
                           "answered (a key is never sent back)")
        server = req.protocol.server if req.protocol is not None else None
        if server is not None and server.shutting_down:
            raise ApiError(503, "Server is shutting down")
        extensions = [ServerPerMessageDeflateFactory(server_max_window_bits=12, client_max_window_bits=12,
                                                     compress_settings={"memLevel": 5})]
        proto = ServerProtocol(extensions=extensions if self.config.compression else None,
                               select_subprotocol=_select_subprotocol, max_size=self.config.max_message_bytes,
                               logger=_wire_log)
        if req.method != "GET":
            return Response(405, status_error_body(405, f"A WebSocket upgrade must be a GET, not {req.method}"),
                            headers=[("allow", "GET")])
        if req.http10:  # (RFC 6455 4.1; the head below is written as HTTP/1.1, so the library would not see it)
            raise ApiError(400, "A WebSocket upgrade needs HTTP/1.1 or later, not HTTP/1.0")
        # the head goes through the protocol object itself, so that it moves on to reading frames
        target = req.path + ("?" + req.query if req.query else "")
        headers = Headers((k.decode("latin-1"), v.decode("latin-1")) for k, v in req.raw_headers)
        proto.receive_data(WsRequest(target, headers).serialize())
        parsed = proto.events_received()
        if not parsed:
            raise ApiError(400, _keyless(f"Bad WebSocket handshake: {proto.handshake_exc}", req))
        resp = proto.accept(parsed[0])
        if resp.status_code != 101:
            msg = _keyless((resp.body or b"").decode("utf-8", "replace").strip() or "WebSocket handshake failed", req)
            extra = [(k, v) for k, v in resp.headers.raw_items() if k.lower() in ("upgrade", "allow")]
            return Response(resp.status_code, status_error_body(resp.status_code, msg), headers=extra)
        proto.send_response(resp)
        head = b"".join(proto.data_to_send())
        return Upgrade(Connection(self, proto, server, self.api.key_of(tokens), req.client, req.forwarded_for), head)

    def _check_auth(self, req: Request, offered: list[str]) -> list[str]:
        """The keys the handshake gave, checked (the connection's client's, for ``--fair-client key``)."""
        auth = self.api.auth  # the same origin rule and keys as the HTTP API
        auth.check_origin(req)
        keys = _offered_keys(offered)
        if len(keys) > 1:  # (each would be tried: a handshake of hundreds of guesses)
            raise ApiError(400, f"Offer one '{KEY_PREFIX}<key>' or '{KEY64_PREFIX}<key>' subprotocol at most, "
                           f"not {len(keys)}")
        tokens = auth.given(req) + keys
        auth.check_key(tokens, f"send 'Authorization: Bearer <key>' or the subprotocol '{KEY_PREFIX}<key>'")
        return tokens


def _keyless(message: str, req: Request) -> str:
    """A handshake refusal's ``message`` without the subprotocol header websockets' own quotes ("expected comma at
    31 in ..."): a key offered there is never sent back (review: an unparsable one was; then, one of two headers)."""
    if "sec-websocket-protocol" in message.lower():
        return ("Failed to open a WebSocket connection: invalid Sec-WebSocket-Protocol header (a comma-separated "
                f"list of tokens; a key with other characters goes as '{KEY64_PREFIX}<base64url of its UTF-8>')")
    offered = (v.decode("latin-1") for k, v in req.raw_headers if k.lower() == b"sec-websocket-protocol")
    for value in sorted((v for v in offered if KEY_PREFIX in v), key=len, reverse=True):  # (any other quote of one)
        message = message.replace(value, "<the Sec-WebSocket-Protocol header>")
    return message


def _offered_subprotocols(req: Request) -> list[str]:
    out = []
    for k, v in req.raw_headers:
        if k.lower() == b"sec-websocket-protocol":
            out += [p.strip(" \t") for p in v.decode("latin-1").split(",") if p.strip(" \t")]
    return out


def _offered_keys(offered: list[str]) -> list[str]:
    """The keys offered as subprotocols: ``tokenmill.key.<key>``, ``tokenmill.key64.<base64url of its UTF-8>``
    (each as its bytes, in Latin-1 characters)."""
    keys = []
    for p in offered:
        if p.startswith(KEY64_PREFIX):
            text = p[len(KEY64_PREFIX):]
            try:
                key = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
            except ValueError:  # (binascii.Error)
                raise ApiError(400, f"'{KEY64_PREFIX}' takes the key as base64url of its UTF-8") from None
            keys.append(key.decode("latin-1"))  # (its bytes, as a header's are: ``Auth.key_number``)
        elif p.startswith(KEY_PREFIX):
            keys.append(p[len(KEY_PREFIX):])
    return keys


def _select_subprotocol(proto: ServerProtocol, offered) -> str | None:
    # (a browser fails the handshake unless one offered value comes back: never a key, refused alone above)
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


def _error_msg(gid: str | None, e: ApiError) -> dict:
    msg: dict = {"type": "error"}
    if gid is not None:
        msg["id"] = gid
    msg["error"] = {"message": e.message, "type": e.type, "param": e.param, "code": e.code_or_status}
    for k, v in e.headers:
        if k == "retry-after":  # beside the error, as HTTP sends it beside the body
            msg["retry_after"] = int(v)
    return msg


class _Live:
    """One generation on a connection: its task, and its ``Generation`` once the body is checked."""

    __slots__ = ("gen", "task")

    def __init__(self, gen: Generation | None, task: asyncio.Task | None) -> None:
        self.gen = gen
        self.task = task

    def abort(self) -> None:
        if self.gen is not None:
            self.gen.abort_unfinished()
        if self.task is not None:
            self.task.cancel()


class Connection(asyncio.Protocol):
    """One upgraded client connection and its generations."""

    def __init__(self, ep: WebSocketEndpoint, proto: ServerProtocol, server: HttpServer | None,
                 key: int | None = None, client: str = "-", forwarded_for: str | None = None) -> None:
        self.ep = ep
        self.key = key  # which API key its handshake gave (OpenAIApi.key_of): its generations' (OpenAIApi.place)
        self.client = client  # its handshake's Request.client: the caller's host, or the one a trusted proxy named
        self.forwarded_for = forwarded_for  # (that one, for the access log: else the connection's host:port)
        self.api = ep.api
        self.config = ep.config
        self.proto = proto
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "-"  # the client's host:port, as it connected (one that reset has none to give by then)
        self.lost = False
        self.live: dict[str, _Live] = {}
        self._side_tasks: set[asyncio.Task] = set()  # the stats round trip
        self._stats_asked: list[str | None] = []  # ids of the stats messages the round trip in flight answers
        self._frags: list[bytes] | None = None  # a fragmented message being put together
        self._frag_opcode = Opcode.TEXT
        self._flush_scheduled = False
        self._ping_payload = b""
        self._ping_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        self._draining = False  # our side is closed: what the client still sends is read and dropped
        self._last_activity = 0.0
        self._tokens = float(ep.config.max_frames_per_second)  # the frame rate limit's bucket
        self._tokens_at = 0.0

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = peer_of(transport)
        self.ep.connections.add(self)
        if self.server is not None:
            self.server.connections.add(self)  # so a graceful shutdown closes it too
        loop = asyncio.get_running_loop()
        self._last_activity = loop.time()
        self._ping_timer = loop.call_later(self.config.ping_interval, self._ping)
        self._idle_timer = loop.call_later(self.config.idle_timeout, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.ep.connections.discard(self)
        if self.server is not None:
            self.server.connections.discard(self)
        for t in (self._ping_timer, self._idle_timer, self._close_timer):
            if t is not None:
                t.cancel()
        self._cancel_all()

    def eof_received(self) -> bool:
        return False  # the client is gone: close, which cancels its generations

    def data_received(self, data: bytes) -> None:
        if self._draining:  # (half-closed: what the client still sends is dropped)
            return
        proto = self.proto
        proto.receive_data(data)
        for frame in proto.events_received():
            if frame.opcode is not Opcode.CLOSE and not self._take_token():
                log.warning("websocket client %s sent more than %d frames a second: closing it",
                            self.transport.get_extra_info("peername"), self.config.max_frames_per_second)
                proto.data_to_send()  # (unsent: the pongs websockets queued for every ping of the flood, as it read)
                self._fail(POLICY, f"more than {self.config.max_frames_per_second} messages a second")
                break
            self._on_frame(frame)
        self._flush()
        if proto.state is not State.OPEN:
            self._cancel_all()
            self._expect_close()

    def _take_token(self) -> bool:
        """A token bucket over frames (messages, fragments, pings): one second's worth of burst. Each frame
        costs the event loop JSON, a reply and compression, so a flood would stall every other client."""
        now = asyncio.get_running_loop().time()
        rate = self.config.max_frames_per_second
        self._tokens = min(float(rate), self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    # ------------------------------------------------------------------ for HttpServer.shutdown

    @property
    def idle(self) -> bool:
        return not self.live

    def close(self) -> None:
        self._close(GOING_AWAY, "server shutting down")

    def abort(self) -> None:
        self._cancel_all()
        if self.transport is not None:
            self.transport.abort()

    # ------------------------------------------------------------------ incoming

    def _on_frame(self, frame: Frame) -> None:
        op_ = frame.opcode
        if op_ is Opcode.TEXT or op_ is Opcode.BINARY:
            if frame.fin:
                self._on_message(op_, frame.data)
            else:
                self._frags, self._frag_opcode = [frame.data], op_
        elif op_ is Opcode.CONT:
            if self._frags is not None:  # the protocol layer already rejects a stray continuation
                self._frags.append(frame.data)
                if frame.fin:
                    data, self._frags = b"".join(self._frags), None
                    self._on_message(self._frag_opcode, data)
        elif op_ is Opcode.PONG:
            if self._ping_payload and frame.data == self._ping_payload:
                self._ping_payload = b""
                self._rearm_ping(self.config.ping_interval)
        elif op_ is Opcode.CLOSE:
            self._cancel_all()

    def _on_message(self, opcode: Opcode, data: bytes) -> None:
        self._last_activity = asyncio.get_running_loop().time()
        if opcode is Opcode.BINARY:
            self._send(_error_msg(None, ApiError(400, "Binary messages are not supported: send JSON text",
                                                 code="unsupported_data")))
            return
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            try:
                bytes(data).decode("utf-8")
            except UnicodeDecodeError:
                self._fail(BAD_DATA, "invalid UTF-8 in a text message")
                return
            self._send(_error_msg(None, ApiError(400, f"Malformed JSON message: {e}")))
            return
        gid = msg.get("id") if isinstance(msg, dict) else None
        if not (isinstance(gid, str) and 0 < len(gid) <= self.config.max_id_length):
            gid = None  # not echoed back
        try:
            if not isinstance(msg, dict):
                raise ApiError(400, "A message must be a JSON object")
            kind = msg.get("type")
            if kind == "completion" or kind == "chat":
                self._start(kind, self._check_id(msg), msg)
            elif kind == "cancel":
                self._cancel(self._check_id(msg))
            elif kind == "stats":
                self._ask_stats(gid)
            else:
                raise ApiError(400, f"Unknown message type {kind!r}: expected 'completion', 'chat', 'cancel' "
                               "or 'stats'", param="type")
        except ApiError as e:
            self._send(_error_msg(gid, e))
        except Exception:  # noqa: BLE001 - one bad message must not take the connection's other generations down
            log.exception("websocket message failed")
            self._send(_error_msg(gid, ApiError(500, "Internal server error")))

    def _check_id(self, msg: dict) -> str:
        gid = msg.get("id")
        if not isinstance(gid, str) or not gid:
            raise ApiError(400, "Missing 'id': every completion, chat and cancel message needs a non-empty "
                           "string id", param="id")
        if len(gid) > self.config.max_id_length:
            raise ApiError(400, f"'id' is longer than {self.config.max_id_length} characters", param="id")
        return gid

    # ------------------------------------------------------------------ generations

    def _start(self, kind: str, gid: str, msg: dict) -> None:
        if gid in self.live:
            raise ApiError(400, f"A generation with id {gid!r} is still running on this connection (it "
                           "goes on); use a new id", param="id", code="duplicate_id")
        if len(self.live) >= self.config.max_generations:
            raise ApiError(429, f"Too many generations on one connection (limit {self.config.max_generations})")
        if self.server is not None and self.server.shutting_down:
            raise ApiError(503, "Server is shutting down")
        if op.parse_n(msg) != 1:
            raise ApiError(400, "Only n=1 is supported over WebSocket: send one message (with its own id) per "
                           "choice", param="n")
        if kind == "completion" and isinstance(p := msg.get("prompt"), list) and len(p) > 1 and not isinstance(p[0], int):
            raise ApiError(400, "One prompt per message over WebSocket: send one message (with its own id) per "
                           "prompt", param="prompt")
        # checking the body may tokenize a big prompt off the loop: the generation is live (and
        # cancellable) from now on, its engine request starts once the body has been read
        live = self.live[gid] = _Live(None, None)
        live.task = asyncio.get_running_loop().create_task(self._run(gid, kind, msg, live, time.monotonic()))

    async def _run(self, gid: str, kind: str, msg: dict, live: _Live, arrival: float) -> None:
        """Check the body, start the generation, forward its batches (one delta per engine step) until it ends."""
        send = self._send
        status = 499  # until it ends otherwise: the client cancelled it or left
        try:
            try:
                job = self.api.completion_job if kind == "completion" else self.api.chat_job
                self.api.include_usage(msg)  # (checked as a stream's: ``done`` carries the usage always)
                live.gen, fmt = await job(msg, arrival)
                self.api.place(live.gen, msg, self.client, self.key)
                live.gen.start()
            except ApiError as e:
                status = e.status
                send(_error_msg(gid, e))
                self._forget(gid, live)
                return
            except Exception:  # noqa: BLE001 - one bad message must not take the connection's other generations down
                status = 500
                log.exception("websocket message failed (generation %r)", gid)
                send(_error_msg(gid, ApiError(500, "Internal server error")))
                self._forget(gid, live)
                return
            status = await self._pump(gid, live, fmt)
        finally:
            if self.ep.access_log is not None:
                gen = live.gen
                self.ep.access_log.websocket(gen.api_id if gen is not None else f"ws-{gid}", self.forwarded_for or self.peer,
                                             status, arrival, gen, msg.get("messages", msg.get("prompt")))

    async def _pump(self, gid: str, live: _Live, fmt) -> int:
        """Forward the generation's updates; the status it ended with (200, or the error's)."""
        gen = live.gen
        choice = gen.choices[0]
        send = self._send
        want_lp = fmt.logprobs
        echo = getattr(fmt, "echo", False)  # a completion's: its prompt
        echo_text = getattr(fmt, "echo_text", "")  # a chat's: the last message it goes on with
        answers = getattr(fmt, "answers", None)  # a chat with tools or thinking: calls are read out of the text
        answer = answers[0] if answers else None
        # vLLM's prompt fields (return_token_ids, prompt_logprobs) go with the first delta, whichever it is
        prompt_fields = bool(fmt.return_token_ids or fmt.prompt_logprobs is not None)

        def delta(msg: dict) -> None:
            nonlocal prompt_fields
            if prompt_fields:
                prompt_fields = False
                msg |= fmt.prompt_fields(choice)
            send(msg)
        try:
            while not gen.done:
                for up in await gen.next_updates():
                    if echo:  # with the first update: the prompt logprobs come with it
                        echo = False
                        text, lp = fmt.echo_of(choice)
                        msg = {"type": "delta", "id": gid, "text": text, "token_ids": choice.prompt_ids}
                        if want_lp:
                            msg["logprobs"] = lp
                        delta(msg)
                    if echo_text:  # (no tokens of the answer's: its logprobs are the answer's own)
                        delta({"type": "delta", "id": gid, "text": echo_text, "token_ids": []})
                        echo_text = ""
                    if answer is not None:
                        answer.parts(up.text, False)
                    if up.text or up.token_ids or up.logprobs or prompt_fields:
                        msg = {"type": "delta", "id": gid, "text": up.text, "token_ids": up.token_ids}
                        if want_lp:
                            msg["logprobs"] = fmt.delta_logprobs(up)
                        delta(msg)
            done = {"type": "done", "id": gid, "finish_reason": choice.finish_reason, "usage": gen.usage()}
            if answer is not None:  # the deltas carried the raw text; done says what the message holds
                answer.parts("", True)
                done["finish_reason"] = fmt.finish_reason(choice)
                done["message"] = fmt.echoed(answer.message())
            send(done)
            return 200
        except ApiError as e:
            send(_error_msg(gid, e))
            return e.status
        except Exception:  # noqa: BLE001
            log.exception("websocket generation %r (request %s) failed", gid, gen.api_id)
            send(_error_msg(gid, ApiError(500, "Internal server error")))
            return 500
        finally:
            gen.abort_unfinished()
            self._forget(gid, live)

    def _forget(self, gid: str, live: _Live) -> None:
        if self.live.get(gid) is live:  # the id may already be reused after a cancel
            del self.live[gid]
        self._generation_ended()

    def _cancel(self, gid: str) -> None:
        """Abort now and say so; cancelling an id that is not running does nothing (it may have just ended)."""
        entry = self.live.pop(gid, None)
        if entry is None:
            return
        entry.abort()
        usage = entry.gen.usage() if entry.gen is not None else usage_dict()
        self._send({"type": "done", "id": gid, "finish_reason": "cancelled", "usage": usage})
        self._generation_ended()

    def _generation_ended(self) -> None:
        if self.lost:
            return
        self._last_activity = asyncio.get_running_loop().time()
        if not self.live and self.server is not None and self.server.shutting_down:
            self.close()

    def _cancel_all(self) -> None:
        live, self.live = self.live, {}
        for entry in live.values():
            entry.abort()
        for task in list(self._side_tasks):
            task.cancel()

    def _ask_stats(self, gid: str | None) -> None:
        """One engine round trip per connection at a time: stats messages sent meanwhile share its answer,
        so a flood of them costs the engine nothing and the connection a bounded list."""
        if len(self._stats_asked) >= self.config.max_pending_stats:
            raise ApiError(429, f"Too many stats requests in flight on this connection (limit "
                           f"{self.config.max_pending_stats}): wait for the answers")
        self._stats_asked.append(gid)
        if len(self._stats_asked) == 1:
            task = asyncio.get_running_loop().create_task(self._stats())
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)

    async def _stats(self) -> None:
        try:
            s = await self.api.client.stats()
        except Exception as e:  # noqa: BLE001 - EngineUnavailable or a timeout
            err = ApiError(503, f"Engine unavailable: {e}")
            for gid in self._take_stats_asked():
                self._send(_error_msg(gid, err))
            return
        msg = {"type": "stats", **stats_fields(s)}
        for gid in self._take_stats_asked():
            self._send(msg if gid is None else {**msg, "id": gid})

    def _take_stats_asked(self) -> list[str | None]:
        asked, self._stats_asked = self._stats_asked, []
        return asked

    # ------------------------------------------------------------------ outgoing

    def _send(self, msg: dict) -> None:
        if self.lost or self.proto.state is not State.OPEN:
            return
        self.proto.send_text(orjson.dumps(msg))
        if not self._flush_scheduled:  # every message of this loop turn goes out in one write
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.lost:
            return
        out = self.proto.data_to_send()
        if not out:
            return
        eof = out[-1] == b""
        if eof:
            out.pop()
        transport = self.transport
        if out:
            transport.writelines(out)
        if eof:  # what is buffered still goes out; the close timer cuts a client that never reads or closes
            if transport.can_write_eof():  # (a close with the client's bytes unread, a flood's, would reset the
                transport.write_eof()  # connection, our close frame and answers lost: half-close, read on)
                self._draining = True
            else:  # TLS: no half-close. uvloop's SSL transport reads on (dropping) while it shuts down, so the
                transport.close()  # close frame and answers still arrive (the stdlib loop's does not: a reset)
            self._expect_close()
        elif transport.get_write_buffer_size() > self.config.max_buffered_bytes:
            log.warning("websocket client %s is not reading: closing it", transport.get_extra_info("peername"))
            self._fail(POLICY, f"client too slow: more than {self.config.max_buffered_bytes} bytes unread")

    def _close(self, code: int, reason: str) -> None:
        """The closing handshake: our close frame now, the TCP close when the client answers (or times out)."""
        self._cancel_all()
        if not self.lost and self.proto.state is State.OPEN:
            self.proto.send_close(code, reason)
            self._flush()
            self._expect_close()

    def _fail(self, code: int, reason: str) -> None:
        self._cancel_all()
        if not self.lost and self.proto.state is State.OPEN:
            self.proto.fail(code, reason)
            self._flush()

    def _expect_close(self) -> None:
        if self._close_timer is None and not self.lost:
            self._close_timer = asyncio.get_running_loop().call_later(self.config.close_timeout, self.abort)

    # ------------------------------------------------------------------ keepalive

    def _rearm_ping(self, delay: float) -> None:
        if self._ping_timer is not None:
            self._ping_timer.cancel()
        self._ping_timer = asyncio.get_running_loop().call_later(delay, self._ping)

    def _ping(self) -> None:
        if self.lost or self.proto.state is not State.OPEN:
            return
        if self._ping_payload:  # the last ping got no pong in time
            self._fail(INTERNAL, "keepalive ping timeout")
            return
        self._ping_payload = os.urandom(4)
        self.proto.send_ping(self._ping_payload)
        self._flush()
        self._rearm_ping(self.config.ping_timeout)

    def _check_idle(self) -> None:
        if self.lost:
            return
        loop = asyncio.get_running_loop()
        left = self._last_activity + self.config.idle_timeout - loop.time()
        if self.live or left > 0:
            delay = self.config.idle_timeout if self.live else max(left, 0.01)
            self._idle_timer = loop.call_later(delay, self._check_idle)
            return
        self._close(NORMAL, "idle timeout")
