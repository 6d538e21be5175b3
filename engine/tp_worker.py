"""Tensor-parallel workers: rank 0 starts them (``launch``); each runs ``worker_main``.

A worker mirrors the driver (nano-vllm's shape): it builds the same ``ModelRunner`` as
rank 0 (so the same model slice and KV cache slice, and the same start-up collectives),
then runs ``ModelRunner.forward_step`` for every step rank 0 broadcasts, until the shutdown
command. It schedules nothing, samples nothing and holds no requests.

Life and death: workers are rank 0's children (multiprocessing spawn) and die with it
(PR_SET_PDEATHSIG, and the collective they wait in fails when it goes). A worker that dies
is found by rank 0 before its next step (``Driver.check``: a waitpid per worker, and for the
ranks on other nodes a poll of the connection each holds to rank 0, ``_accept_links``) or by
the collective it breaks, and the engine fails with a ``TensorParallelError`` naming the rank.
PR_SET_PDEATHSIG follows the thread that started the workers: build a tensor-parallel
engine on a thread that lives as long as it (the engine process's main thread does).

The ranks meet through torch.distributed's TCPStore, which rank 0 opens: on a free port of
127.0.0.1 on one machine, on ``master_addr:master_port`` across machines (``nnodes`` > 1,
torchrun's names). There node 0 runs the engine and its first T/nnodes ranks, and node k > 0
runs ``run_node``: it reads the engine's settings from the store (so every rank builds the
same runner; only the model path is its own), starts ranks k*T/nnodes .. (k+1)*T/nnodes-1 and
exits when they do: 0 after the engine's shutdown command, 1 when the group broke (rank 0
gone). The store and gloo traffic are unauthenticated: a private network only. On the CPU
each rank takes an equal share of its node's threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import weakref

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.lora import AdapterError
from engine.models.config import ModelConfig
from engine.parallel import (
    COLLECTIVE_TIMEOUT,
    Driver,
    LoraCommand,
    TensorParallelError,
    TPGroup,
    check_split,
    init_group,
    stop_processes,
)

log = logging.getLogger("tokenmill.tp")

_UP_KEY = "tokenmill/tp/up/{}"  # a worker sets it once it reached the store, before joining the group
_ENGINE_KEY = "tokenmill/tp/engine"  # rank 0's settings and backend, for the nodes > 0 (JSON)
_LINK_KEY = "tokenmill/tp/link"  # the port each rank on another node connects to rank 0 on (Driver.links)
DEFAULT_MASTER_PORT = 29500  # torchrun's


def span(what: str, first: int, last: int) -> str:
    """``rank 3`` or ``ranks 2-3``."""
    return f"{what} {first}" if first == last else f"{what}s {first}-{last}"


def rendezvous(config: EngineConfig) -> tuple[str, int]:
    """Where the ranks meet: ``(master_addr, master_port)``; port 0 = a free one (one node)."""
    if config.nnodes == 1:
        return config.master_addr or "127.0.0.1", config.master_port or 0
    return config.master_addr, config.master_port or DEFAULT_MASTER_PORT


def launch(config: EngineConfig, model_path: str, model_cfg: ModelConfig, device: torch.device) -> TPGroup:
    """Rank 0: start ranks 1..T-1 and form the group; ``TPGroup()`` when there is one rank."""
    t, n = config.tensor_parallel_size, config.nnodes
    if config.node_rank != 0:
        raise ValueError(f"node_rank {config.node_rank} runs only tensor-parallel workers (`tokenmill engine "
                         f"--node-rank {config.node_rank}`, without --listen); the engine is node 0")
    if t == 1:
        return TPGroup()
    check_split(model_cfg, t)
    local = t // n  # this node's ranks: 0..local-1
    if device.type == "cuda" and torch.cuda.device_count() < local:
        raise ValueError(f"tensor_parallel_size {t} over {n} node(s) needs {local} GPUs here; "
                         f"{torch.cuda.device_count()} are visible")
    if dist.is_initialized():
        raise ValueError("a tensor-parallel engine is already running in this process; close it first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    threads_before = torch.get_num_threads()
    threads = max(1, threads_before // local)
    addr, port = rendezvous(config)
    try:
        store = dist.TCPStore(addr, port, t, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    except RuntimeError as e:
        raise ValueError(f"cannot open the tensor-parallel rendezvous on {addr}:{port}: {e}") from e
    links = None
    if n > 1:
        store.set(_ENGINE_KEY, json.dumps({"config": dataclasses.asdict(config), "backend": backend}))
        try:
            links = socket.create_server((addr, 0), family=socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0][0])
        except OSError as e:
            raise ValueError(f"cannot listen for the other nodes' ranks on {addr}: {e}") from e
        store.set(_LINK_KEY, str(links.getsockname()[1]))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, name=f"tokenmill-tp-{r}", daemon=True,
                         args=(r, t, addr, store.port, backend, config, model_path, threads, os.getpid()))
             for r in range(1, local)]
    remote = f"{span('rank', local, t - 1)} on {span('node', 1, n - 1)}" if n > 1 else ""
    driver = Driver(procs, on_close=lambda: torch.set_num_threads(threads_before), remote=remote)
    driver.store = store  # the group's rendezvous lives as long as the group
    try:
        for p in procs:
            p.start()
        if n > 1:
            log.info("tensor parallel: waiting for %s to join at %s:%d", remote, addr, store.port)
        _wait_for_workers(store, driver, t)
        group = init_group(0, t, store, backend, driver, local)
        if links is not None:
            _accept_links(links, driver, local, t)
    except BaseException:
        driver.close()
        raise
    finally:
        if links is not None:
            links.close()
    if backend == "gloo":
        torch.set_num_threads(threads)
    weakref.finalize(group, driver.close)  # also at exit: the workers get their shutdown command
    log.info("tensor parallel: %d ranks (%s; workers %s)%s%s", t, backend, ", ".join(str(p.pid) for p in procs),
             f", {threads} CPU threads each" if backend == "gloo" else "", f"; {remote}" if remote else "")
    return group


def _wait_for_workers(store: dist.Store, driver: Driver, t: int) -> None:
    """Until every worker reached the store, watching that none died (a dead one would
    otherwise keep rank 0 waiting in the rendezvous until its timeout)."""
    keys = [_UP_KEY.format(r) for r in range(1, t)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        driver.check()
        if time.monotonic() > deadline:
            missing = [r for r in range(1, t) if not store.check([_UP_KEY.format(r)])]
            raise TensorParallelError(f"tensor-parallel ranks {missing} did not join within "
                                      f"{COLLECTIVE_TIMEOUT.total_seconds():.0f}s"
                                      + (f" (are {driver.remote} started?)" if driver.remote else ""))
        time.sleep(0.02)


def _accept_links(server: socket.socket, driver: Driver, local: int, t: int) -> None:
    """Rank 0: the connection of every rank on another node (each sends its rank, 4 bytes), into
    ``driver.links`` (``Driver.link``): when a rank there dies, its kernel closes it, and ``Driver.check`` sees that
    before the next step (a host that goes silent: TCP keepalive, within about half a minute). A
    connection that says no rank of theirs, or one already linked, is dropped."""
    server.settimeout(0.5)
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    waiting = set(range(local, t))
    while waiting:
        driver.check()  # (a local rank that died meanwhile)
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting)} joined the group but did not "
                                      f"connect to rank 0 within {COLLECTIVE_TIMEOUT.total_seconds():.0f}s")
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        try:
            sock.settimeout(5.0)
            hello = b""
            while len(hello) < 4 and (part := sock.recv(4 - len(hello))):
                hello += part
            rank = int.from_bytes(hello, "little") if len(hello) == 4 else -1
        except OSError:
            rank = -1
        if rank not in waiting:
            sock.close()
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        driver.link(f"rank {rank} on node {rank // local}", sock)
        waiting.discard(rank)


def worker_main(rank: int, size: int, addr: str, port: int, backend: str, config: EngineConfig, model_path: str,
                threads: int, parent_pid: int) -> None:
    """Rank ``rank``: join the group, build the same runner as rank 0, mirror its steps."""
    _die_with_parent(parent_pid)
    # its INFO lines would repeat rank 0's (it builds the same runner): warnings and errors only
    logging.basicConfig(level=os.environ.get("TOKENMILL_TP_WORKER_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    local = size // config.nnodes
    if backend == "gloo":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(rank % local)
    store = dist.TCPStore(addr, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(_UP_KEY.format(rank), "1")
    tp = init_group(rank, size, store, backend, local_size=local)
    link = None  # on another node than rank 0: held open for rank 0 to see it close (Driver.links)
    if rank >= local:
        link = socket.create_connection((addr, int(store.get(_LINK_KEY))), timeout=COLLECTIVE_TIMEOUT.total_seconds())
        link.sendall(rank.to_bytes(4, "little"))
    from engine.model_runner import ModelRunner  # here: model_runner imports this module

    code = 0
    try:
        runner = ModelRunner(config, model_path, tp)
        while (step := tp.recv_step()) is not None:
            if isinstance(step, LoraCommand):
                with contextlib.suppress(AdapterError):  # (rank 0 says why)
                    runner.put_adapter(step.slot, step.name, step.path)
            else:
                runner.forward_step(step)
    except Exception as e:
        if rank >= local:  # on another node than rank 0: most likely rank 0 went; its parent says so
            log.error("tensor-parallel rank %d: the group broke (%s)", rank, e)
        elif os.getppid() == parent_pid:  # rank 0 alive: this is news; else its going ended this wait
            log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - on the way out after a failure
        pass
    if link is not None:
        link.close()
    logging.shutdown()
    os._exit(code)  # nothing left to flush: skip the interpreter's teardown of torch (a second or so)


def _die_with_parent(parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; rank 0 decides
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # rank 0 died before prctl took effect
        os._exit(1)


# ----------------------------------------------------------------------------- nodes 1..N-1


def run_node(config: EngineConfig, model_path: str, ready=None) -> int:
    """Node ``config.node_rank`` > 0 of a multi-node engine: join rank 0's rendezvous, start this
    node's ranks with the engine's settings, wait for them. 0 when the engine shut them down,
    1 when the group broke (rank 0 or another rank gone) or the settings disagree."""
    t, n, k = config.tensor_parallel_size, config.nnodes, config.node_rank
    local = t // n
    ranks = range(k * local, (k + 1) * local)
    addr, port = rendezvous(config)
    log.info("node %d of %d: %s of %d, joining %s:%d", k, n, span("rank", ranks[0], ranks[-1]), t, addr, port)
    try:  # the client retries until rank 0's store is up (the nodes may start in any order)
        store = dist.TCPStore(addr, port, t, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        engine = json.loads(store.get(_ENGINE_KEY))
    except RuntimeError as e:
        log.error("cannot reach the engine's rendezvous at %s:%d: %s", addr, port, e)
        return 1
    theirs = engine["config"]
    if (theirs["tensor_parallel_size"], theirs["nnodes"]) != (t, n):
        log.error("node 0 runs tensor_parallel_size %d over %d nodes, this node was told %d over %d",
                  theirs["tensor_parallel_size"], theirs["nnodes"], t, n)
        return 1
    # rank 0's settings (every rank must build the same runner), this node's model path and place
    mine = dataclasses.replace(EngineConfig(**theirs), model=model_path, node_rank=k)
    backend = engine["backend"]
    if backend == "nccl" and torch.cuda.device_count() < local:
        log.error("this node needs %d GPUs for its %s; %d are visible", local, span("rank", ranks[0], ranks[-1]),
                  torch.cuda.device_count())
        return 1
    threads = max(1, torch.get_num_threads() // local)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, name=f"tokenmill-tp-{r}",
                         args=(r, t, addr, port, backend, mine, model_path, threads, os.getpid()))
             for r in ranks]
    del store  # the workers hold their own connections
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for p in procs:
            p.start()
        if ready is not None:
            ready()
        return _wait_node(procs)
    finally:
        stop_processes(procs, 0.0)
        signal.signal(signal.SIGTERM, old)


def _wait_node(procs: list) -> int:
    """Until every rank exited: 0 if all did cleanly; at the first failure, 1 (the rest are stopped)."""
    from multiprocessing.connection import wait

    left = list(procs)
    while left:
        wait([p.sentinel for p in left])
        for p in [p for p in left if p.exitcode is not None]:
            left.remove(p)
            if p.exitcode != 0:
                log.error("%s (pid %d) exited with code %s: the tensor-parallel group broke (is the engine on "
                          "node 0 gone?)", p.name, p.pid, p.exitcode)
                return 1
    log.info("the engine shut its tensor-parallel ranks down")
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
