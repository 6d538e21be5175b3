"""The launcher behind ``tokenmill serve``: start, watch and stop the processes.

D engine processes (``engine.server.run_engine``; D = ``--data-parallel-size``,
each with its own share of the CPU threads, or its own GPUs when there are
enough) and N frontend processes (``frontends.server.run_frontend``), all from
the ``spawn`` context. They meet on ``ipc://`` sockets inside a private runtime
dir (mode 0700, removed at exit); every frontend talks to every engine. With
``--engine tcp://HOST:PORT`` (``options.engine_addresses``) no engine starts here:
the frontends talk to those remote engines, with the shared engine key.
The launcher waits for every READY, prints one line with the URL, then
supervises: a frontend that dies is restarted (same id, so the engine drops
what its previous life asked for); an engine that dies is not restarted: the
others keep serving (``/health`` says "degraded"), and when the last local one
is gone the launcher exits non-zero. SIGINT/SIGTERM: frontends get SIGTERM first and
drain, then the engine stops; exit 0.

Children ignore SIGINT (a terminal's Ctrl-C reaches the whole process group, but
the shutdown order is the launcher's) and get SIGTERM if the launcher dies.
Torch-free: the model loads in the engine process only.

Metrics: the frontends keep theirs in prometheus_client's multiprocess files in
``<runtime dir>/metrics`` (``PROMETHEUS_MULTIPROC_DIR``, set before any child
starts, so before any of them imports prometheus_client), whichever frontend a
scrape reaches shows all of them, and the folder goes with the runtime dir. A
restarted frontend's engine gauges are dropped (``mark_process_dead``); its
counters still count. Every process logs in ``--log-format`` (``frontends.logs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from engine.cache_dir import tokenizer_cache_dir
from engine.config import FAIR_CLIENTS, EngineConfig
from engine.model_path import (
    generation_defaults,
    max_tokens_cap,
    model_name,
    resolve_model_path,
    resolve_tokenizer_path,
)
from engine.protocol import tcp_host_port

log = logging.getLogger("tokenmill.launcher")

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
DRAIN_WORD_S = 2.0  # at a stop, how long an engine may take to say it drains (a step under way: longer, it drains)


class LaunchError(RuntimeError):
    """Start-up failed in a way the user can fix; the message says how."""


def check_address(flag: str, address: str, listen: bool = False) -> None:
    """An engine's address as ZMQ takes it: tcp://HOST:PORT (a port of 1-65535; HOST ``*``, every interface, to
    ``listen`` on) or ipc://PATH."""
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return
    host, port = tcp_host_port(address)
    # a name, an IPv4 address, an IPv6 one in brackets ([::1]), or * to listen on every interface
    named = host.startswith("[") and host.endswith("]") and len(host) > 2 or host and not set("[]:") & set(host)
    if not (named and (listen or host != "*") and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{flag} must be tcp://HOST:PORT (a port of 1-65535) or ipc://PATH, got {address!r}")


def same_engine(address: str) -> tuple[str, str]:
    """What two ways of writing one engine's address share (checked by ``check_address``): a host name's case, an
    IP address's spelling as the resolver reads it ([::1] and [0:0::1], 127.1 and 127.0.0.1, [::ffff:127.0.0.1]),
    a port's leading zeros, a path's ./ and .. (not an abstract socket's, @NAME); not two names of one host."""
    if address.startswith("ipc://"):
        path = address.removeprefix("ipc://")
        return "ipc", path if path.startswith("@") else os.path.abspath(path)
    host, port = tcp_host_port(address)
    if host.startswith("["):  # (a scope's interface, after %, keeps its case: Linux's names have one)
        ip, _, scope = host[1:-1].partition("%")
        with contextlib.suppress(ValueError):
            v6 = ipaddress.IPv6Address(ip)
            ip = str(v6.ipv4_mapped or v6)
        host = ip.lower() + ("%" + scope if scope else "")
    elif set(host) <= set("0123456789abcdefABCDEFxX."):  # an IPv4 address, as inet_aton reads it (127.1, 0x7f.1)
        try:
            host = socket.inet_ntoa(socket.inet_aton(host))
        except OSError:
            host = host.lower()
    else:
        host = host.lower()
    return host, str(int(port))


def check_shutdown_timeout(seconds: float) -> None:
    if not 0 <= seconds < math.inf:
        raise ValueError(f"--shutdown-timeout must be 0 or more seconds, got {seconds:g}")


@dataclass(frozen=True)
class ServeOptions:
    """What ``tokenmill serve`` needs besides the engine config."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    api_server_count: int = 1
    startup_timeout: float = 300.0  # the engine's model load dominates
    engine_liveness_timeout: float = 60.0  # see frontends.server.FrontendArgs
    shutdown_grace: float = 10.0  # --shutdown-timeout: what the frontends give the requests under way
    stop_timeout: float = 20.0  # per group (frontends, past their grace, then engines) before SIGKILL
    engine_death_grace: float = 2.0  # frontends stay up answering 503 after the engine died
    ws: dict = field(default_factory=dict)  # overrides of frontends.websocket.WsConfig fields
    http: dict = field(default_factory=dict)  # overrides of frontends.http.HttpConfig fields
    allowed_origins: list[str] = field(default_factory=list)  # browser origins besides the server's own
    metrics_no_auth: bool = False  # /metrics open even with API keys
    force_include_usage: bool = False  # every stream ends with its usage chunk
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:N" (--return-tokens-as-token-ids)
    log_format: str = "text"  # or "json", for every process
    log_requests: bool = True  # the frontends' access log
    log_prompts: bool = False  # prompts in the access log
    data_parallel_size: int = 1  # local engines (each a whole model, -tp ranks each)
    engine_addresses: list[str] = field(default_factory=list)  # remote engines: start none here
    engine_key: str | None = None  # shared secret of tcp:// engines (ZMQ CURVE)
    tool_call_parser: str = "auto"  # frontends.tools: the format tool_choice "auto" reads
    reasoning_parser: str = "auto"  # frontends.reasoning: <think> split off into reasoning_content
    chat_template: str | None = None  # instead of the model's (the template's text)
    model_aliases: list[str] = field(default_factory=list)  # more names requests may use (--served-model-name)
    media_domains: list[str] = field(default_factory=list)  # hosts of http(s) images fetched (frontends.media)
    media_path: str | None = None  # file:// images from under this folder
    fair_client: str = "address"  # who a client is for the fair policy: "address", its API "key", the body's "user"
    responses_store: str | None = None  # the SQLite file of kept Responses (None: the runtime dir's, removed at stop)
    responses_store_mib: int = 256  # what they may take (0: none kept)

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {self.data_parallel_size}")
        check_shutdown_timeout(self.shutdown_grace)
        if self.engine_addresses and self.data_parallel_size != 1:
            raise ValueError("--data-parallel-size starts local engines; with --engine the remote engines "
                             "are the data-parallel ones (repeat --engine)")
        seen: dict[tuple[str, str], str] = {}
        for a in self.engine_addresses:
            check_address("--engine", a)
            if (twice := seen.get(key := same_engine(a))) is not None:
                said = "" if twice == a else f" (as {twice})"
                raise ValueError(f"--engine {a} is given twice{said}: one engine, two connections of one frontend "
                                 "identity")
            seen[key] = a
            if a.startswith("tcp://") and not self.engine_key:
                raise ValueError(f"--engine {a} needs the engine's key: --engine-key or $TOKENMILL_ENGINE_KEY")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.fair_client not in FAIR_CLIENTS:
            raise ValueError(f"--fair-client must be one of {', '.join(FAIR_CLIENTS)}, got {self.fair_client!r}")
        if self.responses_store_mib < 0:
            raise ValueError(f"--responses-store-mib must be 0 or more, got {self.responses_store_mib}")
        if self.responses_store is not None and self.responses_store_mib:  # (opened once here: a folder...)
            import sqlite3

            from frontends.response_store import connect

            if not os.path.isdir(os.path.dirname(os.path.abspath(self.responses_store))):
                raise ValueError(f"--responses-store {self.responses_store!r}: no such folder")
            try:
                connect(self.responses_store, durable=True).close()
            except (sqlite3.Error, OSError) as e:
                raise ValueError(f"--responses-store {self.responses_store!r}: {e}") from None
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be at least 1, got {self.api_server_count}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for f in (self.ssl_keyfile, self.ssl_certfile):
            if f is not None and not os.path.isfile(f):
                raise ValueError(f"no such file: {f}")
        if self.startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        if not self.engine_liveness_timeout > 0:
            raise ValueError(f"--engine-liveness-timeout must be positive, got {self.engine_liveness_timeout}")
        from frontends.http import TrustedProxies  # (what the frontends will read them with)

        try:
            TrustedProxies(self.http.get("forwarded_allow_ips", ()))
        except ValueError as e:
            raise ValueError(f"--forwarded-allow-ips (or FORWARDED_ALLOW_IPS): {e}") from None
        for name, value in self.http.items():
            if name != "forwarded_allow_ips" and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        for name, value in self.ws.items():
            if not value > 0:
                raise ValueError(f"the WebSocket limit {name} must be positive, got {value}")


# ----------------------------------------------------------------------------- children


def _setup_logging(log_format: str, force: bool = False) -> None:
    from frontends.logs import configure  # torch-free and tiny

    configure(log_format, os.environ.get("TOKENMILL_LOG_LEVEL", "INFO"), LOG_FORMAT, force=force)


def _child_setup(parent_pid: int, log_format: str = "text") -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):  # die with the launcher, even on SIGKILL
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)
    _setup_logging(log_format, force=True)


def _report(conn: Connection, what: str, detail: str | None = None) -> None:
    try:
        conn.send((what, detail))
    except (OSError, ValueError):  # the launcher is gone or stopped listening
        pass


def _engine_main(config: EngineConfig, address: str, log_format: str, grace: float, threads: int | None,
                 cuda_devices: str | None, conn: Connection, parent_pid: int) -> None:
    _child_setup(parent_pid, log_format)
    if cuda_devices is not None:  # before torch sees the GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    if threads is not None:  # data parallel on the CPU: each engine its share (-tp divides it further)
        import torch

        torch.set_num_threads(threads)
    from engine.server import run_engine

    try:
        # (the grace is for a SIGTERM to the whole process group, as systemd sends one: the engine runs its requests
        # on while the frontends give them theirs; stopped by this launcher, after them, it has none left: it says
        # it drains, and the launcher's second SIGTERM ends it at once)
        def on_actor(actor: Any) -> None:
            actor.on_drain = lambda: _report(conn, "draining")

        run_engine(config, address, ready=lambda: _report(conn, "ready"), shutdown_grace=grace, on_actor=on_actor)
    except ValueError as e:  # a setting the model or the machine cannot meet: the message says what to fix
        _report(conn, "error", f"{type(e).__name__}: {e}")
        sys.exit(1)
    except BaseException as e:
        _report(conn, "error", f"{type(e).__name__}: {e}")
        raise


def _frontend_main(args: Any, conn: Connection, parent_pid: int) -> None:
    _child_setup(parent_pid, args.log_format)
    from frontends.server import run_frontend

    try:
        run_frontend(args, ready=lambda: _report(conn, "ready"))
    except BaseException as e:
        _report(conn, "error", f"{type(e).__name__}: {e}")
        raise


@dataclass
class _Child:
    name: str
    target: Any
    args: tuple
    proc: Any = None
    conn: Connection | None = None
    ready: bool = False
    started_at: float = 0.0
    restarts: int = 0

    def start(self, ctx: Any) -> None:
        parent, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=self.target, args=(*self.args, child, os.getpid()), name=self.name)
        self.proc.start()
        child.close()
        log.info("started %s (pid %d)", self.name, self.proc.pid)
        self.conn, self.ready, self.started_at = parent, False, time.monotonic()

    def poll_report(self) -> tuple[str, str | None] | None:
        if self.conn is None:
            return None
        try:
            if self.conn.poll():
                return self.conn.recv()
        except (EOFError, OSError):
            self.conn.close()
            self.conn = None
        return None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()


# ----------------------------------------------------------------------------- launcher


def reserve_port(host: str, port: int) -> tuple[int, socket.socket | None]:
    """``port``, failing early and clearly where it is busy (SO_REUSEPORT would otherwise share it silently);
    0: a free one the system picks, for every frontend to share (each would have picked its own), with the socket
    that holds it until they listen on it (bound, not listening: no connection comes to it; SO_REUSEPORT, as
    theirs), so that no other process takes it while the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:  # TIME_WAIT is fine, a listener is not (a hold shares with no SO_REUSEADDR socket: review)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if host == "::":  # (as the frontends' dual_stack socket: the IPv4 port too)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((host, port))
        if port == 0:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # (after the bind, so no listener's is shared)
            return s.getsockname()[1], s
    except OSError as e:
        s.close()
        raise LaunchError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    s.close()
    return port, None


class Launcher:
    def __init__(self, config: EngineConfig, options: ServeOptions):
        self.options = options
        path = resolve_model_path(config.model)  # FileNotFoundError: a clear message already
        self.config = dataclasses.replace(
            config, model=path, served_model_name=config.served_model_name or model_name(path),
            tokenizer=resolve_tokenizer_path(config.tokenizer, path))
        self.sampling_defaults = generation_defaults(config.generation_config, path, config.override_generation_config)
        self.max_tokens_cap = max_tokens_cap(config.generation_config, self.sampling_defaults,
                                             config.override_generation_config)
        if self.sampling_defaults:  # (as vLLM warns: a request's defaults are no longer OpenAI's)
            log.warning("default sampling values from the model's generation config: %s (--generation-config vllm "
                        "for OpenAI's defaults)", self.sampling_defaults)
        self.runtime_dir: str | None = None
        self.ctx = mp.get_context("spawn")
        self.engines: list[_Child] = []
        self.frontends: list[_Child] = []
        self._stop_signal: int | None = None
        self._stop_time = 0.0
        self._forced = 0  # the second signal, that killed every process
        self.port = options.port  # (the one port 0 picks: run's)

    # -------------------------------------------------------------- public

    def run(self) -> int:
        """Serve until a signal (exit 0; 128 + its number where a second one cut the drain short, as a shell
        reports a process a signal ended) or the engine dies (exit 1)."""
        o = self.options
        self.port, hold = reserve_port(o.host, o.port)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.runtime_dir = tempfile.mkdtemp(prefix="tokenmill-")
        os.chmod(self.runtime_dir, 0o700)
        log.info("runtime dir %s", self.runtime_dir)
        os.mkdir(self.metrics_dir)
        old_env = os.environ.get(METRICS_ENV)
        os.environ[METRICS_ENV] = self.metrics_dir  # the children inherit it
        code = 0  # (a signal during start-up)
        try:
            self._start_all()
            ready = self._wait_ready()
            if hold is not None:  # (the frontends listen on the port now)
                hold.close()
            if ready:
                scheme = "https" if o.ssl_certfile else "http"
                host = f"[{o.host}]" if ":" in o.host else o.host
                n, d = len(self.frontends), len(self.engine_addresses)
                engines = f", {d} {'remote ' if o.engine_addresses else ''}engine{'s' if d != 1 else ''}" \
                    if d > 1 or o.engine_addresses else ""
                print(f"tokenmill serving {self.config.served_model_name} on {scheme}://{host}:{self.port} "
                      f"({n} frontend{'s' if n != 1 else ''}{engines})", flush=True)
                code = self._supervise()
        except LaunchError as e:
            log.error("%s", e)  # before the shutdown noise, so it is the first thing read
            code = 1
        finally:
            if hold is not None:
                hold.close()
            self._shutdown()
            for s, h in old.items():
                signal.signal(s, h)
            if old_env is None:
                os.environ.pop(METRICS_ENV, None)
            else:
                os.environ[METRICS_ENV] = old_env
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return 128 + self._forced if self._forced and code == 0 else code  # (an engine's death says 1 still)

    # -------------------------------------------------------------- start-up

    @property
    def engine_addresses(self) -> list[str]:
        if self.options.engine_addresses:
            return list(self.options.engine_addresses)
        names = ["engine.sock", *(f"engine-{i}.sock" for i in range(1, self.options.data_parallel_size))]
        return [f"ipc://{os.path.join(self.runtime_dir, n)}" for n in names]

    def _engine_resources(self, i: int) -> tuple[int | None, str | None]:
        """Engine ``i``'s CPU threads and GPUs under data parallel (None: as without it)."""
        d = self.options.data_parallel_size
        if d == 1:
            return None, None
        threads = max(1, len(os.sched_getaffinity(0)) // d)
        t = self.config.tensor_parallel_size
        gpus = _visible_gpus() if self.config.device != "cpu" else []
        if len(gpus) >= d * t:  # each engine its own T GPUs; fewer: they share (and -tp takes 0..T-1)
            return threads, ",".join(gpus[i * t:(i + 1) * t])
        return threads, None

    @property
    def metrics_dir(self) -> str:
        return os.path.join(self.runtime_dir, "metrics")

    def _responses_store(self) -> str | None:
        """The SQLite file every frontend keeps Responses in (None: none are kept)."""
        if not self.options.responses_store_mib:
            return None
        return os.path.abspath(self.options.responses_store or os.path.join(self.runtime_dir, "responses.sqlite"))

    def _tokenizer_cache(self) -> str:
        """Where the frontends keep the tokenizer (the first reads it with transformers, seconds; the others, and
        every later run of the same files, read the cache in a tenth of one): the user's cache folder, else the
        runtime dir."""
        return tokenizer_cache_dir(self.config.tokenizer) or os.path.join(self.runtime_dir, "tokenizer")

    def _frontend_args(self, i: int) -> Any:
        try:
            from frontends.http import HttpConfig
            from frontends.media import MediaSources
            from frontends.server import FrontendArgs
            from frontends.websocket import WsConfig
        except ImportError as e:
            raise LaunchError(f"cannot import the frontend: {e}") from e

        o = self.options
        addresses = self.engine_addresses
        return FrontendArgs(
            engine_address=addresses[0] if len(addresses) == 1 else addresses, engine_key=o.engine_key,
            tokenizer_path=self.config.tokenizer,
            served_model_name=self.config.served_model_name, host=o.host, port=self.port,
            api_keys=list(o.api_keys), ssl_keyfile=o.ssl_keyfile, ssl_certfile=o.ssl_certfile,
            frontend_id=self._frontend_id(i), tokenizer_cache_dir=self._tokenizer_cache(),
            handshake_timeout=o.startup_timeout, engine_liveness_timeout=o.engine_liveness_timeout,
            allowed_origins=list(o.allowed_origins), http=HttpConfig(**o.http), ws=WsConfig(**o.ws),
            metrics_no_auth=o.metrics_no_auth, force_include_usage=o.force_include_usage, log_format=o.log_format,
            tokens_as_ids=o.tokens_as_ids,
            log_requests=o.log_requests,
            log_prompts=o.log_prompts, tool_call_parser=o.tool_call_parser, reasoning_parser=o.reasoning_parser,
            chat_template=o.chat_template, sampling_defaults=self.sampling_defaults, max_tokens_cap=self.max_tokens_cap,
            model_aliases=list(o.model_aliases), media=MediaSources(tuple(o.media_domains), o.media_path),
            fair_client=o.fair_client, responses_store=self._responses_store(), responses_store_mib=o.responses_store_mib,
            responses_store_durable=o.responses_store is not None, shutdown_grace=o.shutdown_grace)

    def _frontend_id(self, i: int) -> str:
        """Its ZMQ identity. Stable across its restarts (the engine then drops what its previous life
        asked for); a remote engine may serve frontends of several machines, so there it names this
        host and launcher too (ROUTER_HANDOVER would otherwise hand one's identity to the other)."""
        if self.options.engine_addresses:
            return f"{socket.gethostname()}-{os.getpid()}-frontend-{i}"
        return f"frontend-{i}"

    def _start_all(self) -> None:
        # Engine and frontends start together: tokenizer loading overlaps the model
        # load, and frontends keep saying HELLO until the engine answers.
        if not self.options.engine_addresses:
            d = self.options.data_parallel_size
            for i, address in enumerate(self.engine_addresses):
                name = "tokenmill-engine" if d == 1 else f"tokenmill-engine-{i}"
                self.engines.append(_Child(name, _engine_main, (self.config, address, self.options.log_format,
                                                                self.options.shutdown_grace,
                                                                *self._engine_resources(i))))
            for e in self.engines:
                e.start(self.ctx)
        for i in range(self.options.api_server_count):
            fe = _Child(f"tokenmill-frontend-{i}", _frontend_main, (self._frontend_args(i),))
            fe.start(self.ctx)
            self.frontends.append(fe)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.options.startup_timeout
        children = [*self.engines, *self.frontends]
        while not all(c.ready for c in children):
            if self._stop_signal is not None:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                late = ", ".join(c.name for c in children if not c.ready)
                hint = ("are the remote engines up, and is --engine-key theirs?" if self.options.engine_addresses
                        else "raise --startup-timeout for a slow model load")
                raise LaunchError(f"start-up timed out after {self.options.startup_timeout:g}s "
                                  f"waiting for: {late} ({hint})")
            wait([c.conn for c in children if c.conn is not None] + [c.proc.sentinel for c in children],
                 timeout=min(left, 0.5))
            for c in children:
                report = c.poll_report()
                if report is not None:
                    what, detail = report
                    if what == "error":
                        raise LaunchError(f"{c.name} failed to start: {detail}")
                    c.ready = True
                    log.info("%s is ready (%.1fs)", c.name, time.monotonic() - c.started_at)
                elif not c.ready and not c.alive:
                    raise LaunchError(f"{c.name} exited with code {c.proc.exitcode} during start-up "
                                      "(see its log above)")
        return True

    # -------------------------------------------------------------- supervision

    def _supervise(self) -> int:
        gone: set[str] = set()  # engines whose exit was logged (an exit seen only here would go unsaid)
        while self._stop_signal is None:
            live = [e for e in self.engines if e.name not in gone]
            wait([e.proc.sentinel for e in live] + [f.proc.sentinel for f in self.frontends]
                 + [f.conn for f in self.frontends if f.conn is not None], timeout=0.5)
            if self._stop_signal is not None:
                break
            for e in live:
                if not e.alive:
                    gone.add(e.name)
                    left = sum(x.alive for x in self.engines)
                    log.error("%s exited with code %s%s", e.name, e.proc.exitcode,
                              f"; serving on with {left} of {len(self.engines)} engines" if left else "")
            if self.engines and not any(e.alive for e in self.engines):
                log.error("no engine left; shutting down")
                # The frontends saw the engine go at once and answer 503 (/health too):
                # keep them up a moment so clients read a 503, not a refused connection.
                self._sleep_unless_signalled(self.options.engine_death_grace)
                return 1
            for fe in self.frontends:
                report = fe.poll_report()
                if report is not None and report[0] == "ready":
                    fe.ready = True
                    log.info("%s is ready again", fe.name)
                if not fe.alive:
                    self._restart(fe)
        log.info("received %s; shutting down", signal.Signals(self._stop_signal).name)
        return 0

    def _sleep_unless_signalled(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self._stop_signal is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))

    def _restart(self, fe: _Child) -> None:
        # Back off when it keeps dying right after start (a crash loop, not a one-off).
        quick = time.monotonic() - fe.started_at < 10.0
        fe.restarts = fe.restarts + 1 if quick else 0
        log.warning("%s exited with code %s; restarting", fe.name, fe.proc.exitcode)
        fe.proc.join()
        self._forget_metrics_of(fe.proc.pid)
        if fe.restarts:
            self._sleep_unless_signalled(min(0.25 * 2 ** fe.restarts, 5.0))
        dead = [i for i, e in enumerate(self.engines) if not e.alive]
        if dead:  # data parallel, degraded: the new life must not wait for engines that are gone
            fe.args = (dataclasses.replace(fe.args[0], dead_engines=dead), *fe.args[1:])
        fe.start(self.ctx)

    def _forget_metrics_of(self, pid: int) -> None:
        """A dead frontend's engine gauges must not outlive it (its counters and histograms stay)."""
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.metrics_dir)
        except (ImportError, OSError) as e:
            log.warning("could not drop the metrics of pid %d: %s", pid, e)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._stop_signal is not None:
            # A second Ctrl-C stops waiting for drains; one arriving at once is the
            # same stop delivered twice (to the process group and by a supervisor).
            if time.monotonic() - self._stop_time < 1.0:
                return
            log.warning("second signal: killing all processes")
            for c in [*self.frontends, *self.engines]:
                if c.alive:
                    c.proc.kill()
                    self._forced = signum  # (cut short: not where every process had stopped already)
            return
        self._stop_signal = signum
        self._stop_time = time.monotonic()

    # -------------------------------------------------------------- shutdown

    def _shutdown(self) -> None:
        o = self.options
        self._terminate([f for f in self.frontends if f.alive], o.shutdown_grace + o.stop_timeout)  # they drain...
        self._terminate([e for e in self.engines if e.alive], o.stop_timeout, drains=True)  # ...then the engines stop
        for c in [*self.frontends, *self.engines]:
            if c.conn is not None:
                c.conn.close()

    def _terminate(self, children: list[_Child], timeout: float, drains: bool = False) -> None:
        """SIGTERM, up to ``timeout`` to exit, then SIGKILL. ``drains``: the engines, after the frontends: with no
        frontend left to send them anything, one that says it drains (``--shutdown-timeout``) gets a second SIGTERM,
        which ends it at once (its drain's quiet would take ``QUIET_S`` and ``GOODBYE_S`` more)."""
        # (one that drains already, from a SIGTERM to the whole process group, takes this one as its second)
        not_draining = [c for c in children if drains and c.conn is not None and not _says_draining(c.conn, 0.0)]
        for c in children:
            c.proc.terminate()
        deadline = time.monotonic() + timeout
        for c in not_draining:
            if _says_draining(c.conn, min(DRAIN_WORD_S, deadline - time.monotonic())):
                c.proc.terminate()
        for c in children:
            c.proc.join(max(0.0, deadline - time.monotonic()))
            if c.proc.is_alive():
                log.warning("%s did not stop within %.0fs; killing it", c.name, timeout)
                c.proc.kill()
                c.proc.join()


def _says_draining(conn: Connection, timeout: float) -> bool:
    """Whether a child says, within ``timeout``, that it drains (what else it says then is of no use)."""
    end = time.monotonic() + timeout
    try:
        while conn.poll(max(0.0, end - time.monotonic())):
            if conn.recv()[0] == "draining":
                return True
    except (EOFError, OSError):  # (it ended)
        pass
    return False


def _visible_gpus() -> list[str]:
    """GPU ids the engines may use, without importing torch: $CUDA_VISIBLE_DEVICES, else nvidia-smi's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """``tokenmill serve``: the process exit code."""
    _setup_logging(options.log_format)
    try:
        launcher = Launcher(config, options)
    except (FileNotFoundError, ValueError) as e:  # a usage error, like a bad flag
        log.error("%s", e)
        return 2
    try:
        return launcher.run()
    except LaunchError as e:
        log.error("%s", e)
        return 1
