"""The frontend process: tokenizer, engine handshake, the listening socket, graceful exit.

``run_frontend(args, ready)`` is what the launcher starts in each frontend
process. With several engine addresses (data parallel, or remote engines) it talks
to them through an ``EngineRouter``. It also sets up what an operator watches: ``/metrics`` (every frontend's,
see ``frontends.metrics``), the access log (``frontends.access_log``) and the log format. All frontends bind the same port with SO_REUSEPORT, so the kernel
spreads connections over them. On SIGTERM/SIGINT a frontend stops accepting,
lets in-flight requests finish for ``shutdown_grace`` seconds, aborts the rest
in the engine, and returns.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sqlite3
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

from frontends import logs, websocket
from frontends.access_log import AccessLog
from frontends.auth import loopback_only
from frontends.engine_client import EngineClient
from frontends.engine_router import EngineRouter
from frontends.http import HttpConfig, HttpServer, Router
from frontends.images import ImageProcessor
from frontends.llamacpp import LlamaCppApi
from frontends.media import MediaReader, MediaSources
from frontends.metrics import Metrics
from frontends.ollama import OllamaApi
from frontends.openai_api import OpenAIApi
from frontends.response_store import ResponseStore
from frontends.stored_api import StoredApi
from frontends.text import TextCodec
from frontends.tgi import TgiApi
from frontends.tls import protocol
from frontends.tokenizer import load_tokenizer

log = logging.getLogger("tokenmill.frontend")


@dataclass
class FrontendArgs:
    engine_address: str | list[str]  # several: data parallel, one request (with its n choices) per engine
    tokenizer_path: str  # the model's folder or .gguf file, or --tokenizer's
    served_model_name: str
    host: str
    port: int
    api_keys: list[str] = field(default_factory=list)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    frontend_id: str = "frontend-0"
    allowed_origins: list[str] = field(default_factory=list)  # browser origins besides our own ("*": any)
    tokenizer_cache_dir: str | None = None
    shutdown_grace: float = 10.0  # seconds in-flight requests get after SIGTERM
    handshake_timeout: float = 120.0  # the engine may still be loading its model
    # an engine silent this long (no step ends, no answer to pings) is taken for hung: 503 for all
    engine_liveness_timeout: float = 60.0
    http: HttpConfig = field(default_factory=HttpConfig)  # the HTTP layer's limits
    ws: websocket.WsConfig = field(default_factory=websocket.WsConfig)  # /v1/stream limits
    metrics_no_auth: bool = False  # /metrics without an API key (a scraper on a private network)
    force_include_usage: bool = False  # every stream ends with its usage chunk (--enable-force-include-usage)
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:N" (--return-tokens-as-token-ids)
    log_format: str = "text"  # or "json": one object per line
    log_requests: bool = True  # one access-log line per finished request
    log_prompts: bool = False  # the prompt in that line (user data: off by default)
    engine_key: str | None = None  # shared secret of tcp:// engines (ZMQ CURVE, protocol.curve_keys)
    dead_engines: list[int] = field(default_factory=list)  # indices of engines gone before this start
    tool_call_parser: str = "auto"  # "auto" (from the chat template), a format of frontends.tools, or "none"
    reasoning_parser: str = "auto"  # "auto" (from the chat template), "none", or a name that turns it on
    chat_template: str | None = None  # instead of the model's (``--chat-template``)
    sampling_defaults: dict = field(default_factory=dict)  # for fields a request leaves out (--generation-config)
    max_tokens_cap: int | None = None  # on every request's max_tokens (engine.model_path.max_tokens_cap)
    model_aliases: list[str] = field(default_factory=list)  # names besides served_model_name a request may use
    media: MediaSources = field(default_factory=MediaSources)  # where images may come from besides data: URLs
    fair_client: str = "address"  # who a client is for the fair policy: "address", its API "key", the body's "user"
    responses_store: str | None = None  # the SQLite file of kept Responses, shared by the frontends (None: none kept)
    responses_store_mib: int = 256  # what they may take (frontends.response_store: the bound)
    responses_store_durable: bool = False  # the user's file: commits survive a power loss


def engine_client(args: FrontendArgs) -> EngineClient | EngineRouter:
    """One ``EngineClient``, or an ``EngineRouter`` over one per engine (data parallel)."""
    addresses = [args.engine_address] if isinstance(args.engine_address, str) else list(args.engine_address)
    clients = [EngineClient(a, args.frontend_id, handshake_timeout=args.handshake_timeout,
                            liveness_timeout=args.engine_liveness_timeout, engine_key=args.engine_key)
               for a in addresses]
    return clients[0] if len(clients) == 1 else EngineRouter(clients, args.dead_engines)


def ssl_context(args: FrontendArgs) -> ssl.SSLContext | None:
    if not (args.ssl_keyfile or args.ssl_certfile):
        return None
    if not (args.ssl_keyfile and args.ssl_certfile):
        raise ValueError("TLS needs both ssl_keyfile and ssl_certfile")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=_no_passphrase)
    return ctx


def dual_stack(port: int) -> socket.socket:
    """``--host ::``: one socket for IPv6 and IPv4 on ``port``, as uvicorn's (so vLLM's) is; asyncio makes its
    own IPv6 alone. SO_REUSEPORT: every frontend binds it."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(("::", port))
    except OSError:
        sock.close()
        raise
    return sock


def _no_passphrase() -> str:
    """OpenSSL asks for an encrypted key's passphrase: on a terminal it waited there, else it failed as EINVAL."""
    raise ValueError("the --ssl-keyfile key is encrypted: give it unencrypted (openssl pkey -in KEY -out PLAIN)")


def build_router(api: OpenAIApi, ws: websocket.WsConfig | None = None, access_log: AccessLog | None = None,
                 model_path: str = "") -> Router:
    """The HTTP API's routes (OpenAI's, llama.cpp's, TGI's, Ollama's), ``/v1/stream`` and the chat page."""
    router = api.routes()
    llamacpp = LlamaCppApi(api, model_path)
    llamacpp.routes(router)
    TgiApi(api).routes(router, llamacpp.tokenize, api.invocations)
    OllamaApi(api, llamacpp, model_path).routes(router)
    StoredApi(api).routes(router)
    websocket.register(router, api, ws, access_log)
    return router


async def serve(args: FrontendArgs, ready: Callable[[], None] | None = None) -> None:
    loop = asyncio.get_running_loop()
    tls = ssl_context(args)
    codec = TextCodec(await asyncio.to_thread(load_tokenizer, args.tokenizer_path, args.tokenizer_cache_dir,
                                              args.chat_template))
    client = engine_client(args)
    await client.connect()
    store = None
    try:  # (a start-up that fails after connecting closes the client and the store too)
        if client.ready.model != args.served_model_name:
            log.warning("the engine serves %r, this frontend calls it %r", client.ready.model, args.served_model_name)
        if codec.vocab_size > client.ready.vocab_size:  # (fewer is common: models pad their embeddings)
            log.warning("the tokenizer (%s) has %d tokens, the model only %d: texts holding the others are refused",
                        args.tokenizer_path, codec.vocab_size, client.ready.vocab_size)
        metrics = Metrics(args.served_model_name, client.ready.max_model_len)
        # per-engine gauges carry the engine's index (label "engine")
        for i, c in enumerate(client.clients if isinstance(client, EngineRouter) else [client]):
            metrics.watch(c, str(i))
        image_processor = None
        if client.ready.image_tokens:
            try:
                image_processor = ImageProcessor.load(args.tokenizer_path)
                codec.use_images(client.ready.image_token_id)
            except ValueError as e:
                log.warning("images refused: %s", e)
                image_processor = str(e)
        if args.responses_store:
            store = ResponseStore(args.responses_store, args.responses_store_mib << 20, args.responses_store_durable)
            try:
                await store.open()
            except (sqlite3.Error, OSError) as e:
                raise ValueError(f"--responses-store {args.responses_store}: {e}") from None
        api = OpenAIApi(client, codec, args.served_model_name, args.api_keys,
                        allowed_origins=args.allowed_origins, metrics=metrics, metrics_no_auth=args.metrics_no_auth,
                        force_include_usage=args.force_include_usage, tokens_as_ids=args.tokens_as_ids,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        sampling_defaults=args.sampling_defaults, max_tokens_cap=args.max_tokens_cap,
                        model_aliases=args.model_aliases, images=image_processor, media=MediaReader(args.media),
                        fair_client=args.fair_client, responses_store=store, loopback=loopback_only(args.host))
        access_log = AccessLog(metrics, enabled=args.log_requests, log_prompts=args.log_prompts)
        router = build_router(api, args.ws, access_log, args.tokenizer_path)
        access_log.router = router
        http = HttpServer(router, args.http, observer=access_log)
        # What start-up made (the tokenizer, and transformers and torch when it was read without the
        # cache) lives as long as the process: out of the cyclic GC's sight, a request that allocates
        # many objects (a 50k-prompt list) no longer costs every stream a full-heap collection (~0.25 s).
        gc.freeze()
        where = {"sock": dual_stack(args.port)} if args.host.strip("[]") == "::" else \
            {"host": args.host, "port": args.port, "reuse_port": True}
        # TLS in a layer of our own, so that a handshake counts as a connection (``frontends.tls``)
        server = await loop.create_server(protocol(http, tls), backlog=2048, **where)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("frontend %s serving %s on %s:%d (tool calls: %s; thinking split off: %s)", args.frontend_id,
                 args.served_model_name, args.host, args.port, api.tool_format or "only 'required' or named",
                 "harmony's analysis channel" if api.harmony else "yes" if api.thinking else "no")
        if ready is not None:
            ready()
        try:
            await stop.wait()
        finally:
            server.close()  # stop accepting; live connections stay
            await http.shutdown(args.shutdown_grace, cut=lambda: client.fail_all(
                f"The server is shutting down: not finished within its {args.shutdown_grace:g}s grace"))
            if api.background is not None:  # (its background Responses fail: the engine is no longer reached)
                await api.background.close()
    finally:
        await client.close()
        if store is not None:
            await store.close()


def run_frontend(args: FrontendArgs, ready: Callable[[], None] | None = None) -> None:
    """Process entry: serve until SIGTERM/SIGINT, then return (exit status 0)."""
    import uvloop

    # the launcher's children log already (in its format); a frontend started on its own sets up its own
    logs.configure(args.log_format, logging.INFO, f"%(asctime)s {args.frontend_id} %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(args, ready))
