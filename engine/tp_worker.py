"""Tensor-parallel workers: rank 0 starts them (``launch``); each runs ``worker_main``.

A worker mirrors the driver (nano-vllm's shape): it builds the same ``ModelRunner`` as
rank 0 (so the same model slice and KV cache slice, and the same start-up collectives),
then runs ``ModelRunner.forward_step`` for every step rank 0 broadcasts, until the shutdown
command. It schedules nothing, samples nothing and holds no requests.

Life and death: workers are rank 0's children (multiprocessing spawn) and die with it
(PR_SET_PDEATHSIG, and the collective they wait in fails when it goes). A worker that dies
is found by rank 0 before its next step (``Driver.check``, a waitpid per worker) or by the
collective it breaks, and the engine fails with a ``TensorParallelError`` naming the rank.
PR_SET_PDEATHSIG follows the thread that started the workers: build a tensor-parallel
engine on a thread that lives as long as it (the engine process's main thread does).

The ranks meet through a TCPStore that rank 0 opens on a free port of 127.0.0.1 (one
machine). On the CPU each rank takes an equal share of the threads.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import weakref

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.parallel import COLLECTIVE_TIMEOUT, Driver, TensorParallelError, TPGroup, check_split, init_group

log = logging.getLogger("tokenmill.tp")

_UP_KEY = "tokenmill/tp/up/{}"  # a worker sets it once it reached the store, before joining the group


def launch(config: EngineConfig, model_path: str, model_cfg: ModelConfig, device: torch.device) -> TPGroup:
    """Rank 0: start ranks 1..T-1 and form the group; ``TPGroup()`` when there is one rank."""
    t = config.tensor_parallel_size
    if t == 1:
        return TPGroup()
    check_split(model_cfg, t)
    if device.type == "cuda" and torch.cuda.device_count() < t:
        raise ValueError(f"tensor_parallel_size {t} needs {t} GPUs; {torch.cuda.device_count()} are visible")
    if dist.is_initialized():
        raise ValueError("a tensor-parallel engine is already running in this process; close it first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    threads_before = torch.get_num_threads()
    threads = max(1, threads_before // t)
    store = dist.TCPStore("127.0.0.1", 0, t, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, name=f"tokenmill-tp-{r}", daemon=True,
                         args=(r, t, store.port, backend, config, model_path, threads, os.getpid()))
             for r in range(1, t)]
    driver = Driver(procs, on_close=lambda: torch.set_num_threads(threads_before))
    driver.store = store  # the group's rendezvous lives as long as the group
    try:
        for p in procs:
            p.start()
        _wait_for_workers(store, driver, t)
        group = init_group(0, t, store, backend, driver)
    except BaseException:
        driver.close()
        raise
    if backend == "gloo":
        torch.set_num_threads(threads)
    weakref.finalize(group, driver.close)  # also at exit: the workers get their shutdown command
    log.info("tensor parallel: %d ranks (%s; workers %s)%s", t, backend, ", ".join(str(p.pid) for p in procs),
             f", {threads} CPU threads each" if backend == "gloo" else "")
    return group


def _wait_for_workers(store: dist.Store, driver: Driver, t: int) -> None:
    """Until every worker reached the store, watching that none died (a dead one would
    otherwise keep rank 0 waiting in the rendezvous until its timeout)."""
    keys = [_UP_KEY.format(r) for r in range(1, t)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        driver.check()
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel workers did not start within "
                                      f"{COLLECTIVE_TIMEOUT.total_seconds():.0f}s")
        time.sleep(0.02)


def worker_main(rank: int, size: int, port: int, backend: str, config: EngineConfig, model_path: str,
                threads: int, parent_pid: int) -> None:
    """Rank ``rank``: join the group, build the same runner as rank 0, mirror its steps."""
    _die_with_parent(parent_pid)
    # its INFO lines would repeat rank 0's (it builds the same runner): warnings and errors only
    logging.basicConfig(level=os.environ.get("TOKENMILL_TP_WORKER_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    if backend == "gloo":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(_UP_KEY.format(rank), "1")
    tp = init_group(rank, size, store, backend)
    from engine.model_runner import ModelRunner  # here: model_runner imports this module

    code = 0
    try:
        runner = ModelRunner(config, model_path, tp)
        while (step := tp.recv_step()) is not None:
            runner.forward_step(step)
    except Exception:
        if os.getppid() == parent_pid:  # rank 0 alive: this is news; else its going ended this wait
            log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - on the way out after a failure
        pass
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
