"""Tensor parallelism: the group of ranks, the collectives the model's layers call, how the
model splits across ranks, and the one message per step by which rank 0 tells the others
what to compute.

Rank 0 is the engine process: it alone schedules and samples. Ranks 1..T-1 are its workers
(``engine.tp_worker``): each holds a slice of every weight and of the KV cache and runs the
same forward as rank 0 (``ModelRunner.forward_step``), in lock step. Per step rank 0
broadcasts a fixed-size header (a command and the sizes) and then one packed int64 payload
(``StepInput.pack``): no pickles on the hot path.

The split (Megatron's): q/k/v and gate/up are column-parallel (each rank computes its heads,
its part of the MLP), o and down are row-parallel (partial sums, all-reduced), the embedding
is vocab-parallel (each rank looks up the ids in its range, zeros elsewhere, all-reduced)
and so is the LM head (each rank computes its vocab columns; rank 0 gathers them). Query
heads split evenly; KV heads split evenly when there are at least as many as ranks, and
otherwise are replicated: each rank keeps the one KV head its query heads read.

Two process groups: ``group`` (NCCL on CUDA, gloo on CPU) carries the model's all-reduces
and the logits gather; ``cpu_group`` (gloo; the same group on CPU) carries the step
messages and the start-up agreement on the number of KV blocks, so that a dead peer shows
up at once, as a closed connection. Every collective has a finite timeout
(``COLLECTIVE_TIMEOUT``) except a worker's wait for the next header: an idle engine sends
nothing, and its workers wait for as long as it idles.

Across machines (``nnodes`` > 1) the ranks of node k are k*L .. (k+1)*L-1 (L = T / nnodes
local ranks, local rank = rank % L picks the GPU). Rank 0 cannot waitpid the ranks of other
nodes: one that dies shows up as the next step's collective failing (gloo raises on the
closed connection), and the error says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.models.config import ModelConfig

COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # a hung (not dead) peer fails the engine after this
_IDLE_TIMEOUT = timedelta(days=365)  # a worker waiting for the next step
HEADER_LEN = 8  # int64s: [command, num_seqs, num_tokens, num logits rows, num block table writes, num LoRA slots, 0, 0]
CMD_STEP, CMD_SHUTDOWN, CMD_LORA = 1, 2, 3


class TensorParallelError(RuntimeError):
    """The tensor-parallel group cannot go on (a rank died, a collective failed)."""


# ----------------------------------------------------------------------------- the split


def check_split(cfg: ModelConfig, tp_size: int) -> None:
    """Refuse, with the numbers, a model that does not split over ``tp_size`` ranks."""
    t = tp_size
    if cfg.num_heads % t:
        raise ValueError(f"tensor_parallel_size {t} does not divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % t and t % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {t} does not fit the model's {cfg.num_kv_heads} KV heads: they "
                         f"must be divisible by it, or divide it (then each is replicated on "
                         f"tensor_parallel_size / num_kv_heads ranks)")
    widths = [("intermediate size", cfg.intermediate_size)]
    if cfg.moe is not None:
        widths += [("expert width", cfg.moe.intermediate_size), ("shared expert's width",
                                                                 cfg.moe.shared_intermediate_size)]
    for what, width in widths:
        if width % t:
            raise ValueError(f"tensor_parallel_size {t} does not divide the model's {what} {width}")


def kv_replicas(num_kv_heads: int, tp_size: int) -> int:
    """How many ranks keep a copy of each KV head (1: KV heads are split, not replicated)."""
    return max(1, tp_size // num_kv_heads)


def local_model_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """One rank's share of the model's heads and MLP (what its KV cache and layers hold)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp_size,
                               num_kv_heads=cfg.num_kv_heads * kv_replicas(cfg.num_kv_heads, tp_size) // tp_size,
                               intermediate_size=cfg.intermediate_size // tp_size)


# ----------------------------------------------------------------------------- one step's inputs


@dataclass
class StepInput:
    """One step's inputs as plain data: what every rank needs to run the same forward. Block tables
    travel as the writes that bring each rank's persistent copy (``step_buffers.BlockTables``, rank
    0's, mirrored) up to date, never whole: a step's message does not grow with the context held."""

    query_lens: list[int]  # new tokens of each sequence
    computed_lens: list[int]  # tokens of each sequence already in the KV cache
    token_ids: list[int]  # the new tokens, flat, sequence after sequence
    logits_rows: list[int]  # rows of the flat batch whose logits rank 0 needs, in that order
    table_rows: list[int]  # each sequence's row of the block tables
    write_at: list[int]  # flat index into the tables...
    write_ids: list[int]  # ...and the block id to write there
    lora_slots: list[int] = field(default_factory=list)  # with LoRA adapters: each sequence's slot (-1: none)

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, payload): the sizes, then everything in one int64 tensor."""
        flat = [*self.query_lens, *self.computed_lens, *self.table_rows, *self.token_ids, *self.logits_rows,
                *self.write_at, *self.write_ids, *self.lora_slots]
        header = [CMD_STEP, len(self.query_lens), len(self.token_ids), len(self.logits_rows), len(self.write_at),
                  len(self.lora_slots)]
        return _header(*header), torch.tensor(flat, dtype=torch.int64)

    @classmethod
    def unpack(cls, header: list[int], payload: torch.Tensor) -> StepInput:
        _, b, t, r, w, s = header[:6]
        v = payload.tolist()
        ends = list(itertools.accumulate([b, b, b, t, r, w, w, s]))
        q, c, rows, tokens, logits, at, ids, slots = (v[lo:hi] for lo, hi in zip([0, *ends], ends, strict=False))
        return cls(q, c, tokens, logits, rows, at, ids, slots)

    @staticmethod
    def payload_len(header: list[int]) -> int:
        _, b, t, r, w, s = header[:6]
        return 3 * b + t + r + 2 * w + s


@dataclass
class LoraCommand:
    """Rank 0's word to its workers: put LoRA adapter ``name`` (PEFT folder ``path``) into ``slot``
    (``ModelRunner.put_adapter``)."""

    slot: int
    name: str
    path: str


def _header(*values: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


# ----------------------------------------------------------------------------- the group


class TPGroup:
    """This process's place in the tensor-parallel group, and the collectives over it.

    ``TPGroup()`` is the single rank of an engine without tensor parallelism: every
    collective is then a no-op, and no torch.distributed state exists.
    """

    def __init__(self, rank: int = 0, size: int = 1, group=None, cpu_group=None,
                 driver: Driver | None = None, local_size: int | None = None):
        self.rank, self.size = rank, size
        self.local_size = local_size or size  # ranks on this node (size / nnodes)
        self.group, self.cpu_group = group, cpu_group
        self.driver = driver  # rank 0 of a group: its workers
        # rank 0 over gloo: a worker found dead before each collective of the forward is posted to it (gloo can wait
        # out its whole timeout on a peer whose close it saw first: a killed worker stalled a step for 5 minutes).
        # (Not on NCCL: its collectives are the GPU's, often in a graph; a waitpid per layer there is host time.)
        self._watch = driver if driver is not None and group is cpu_group else None

    # ------------------------------------------------------------------ collectives (every rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            if self._watch is not None:
                self._watch.check()
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` (same shape), concatenated along the last dim on rank 0; None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self._watch is not None:
            self._watch.check()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_over_ranks(self, n: int) -> int:
        """The smallest of every rank's ``n`` (e.g. the KV blocks that fit everywhere)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        except RuntimeError as e:
            if self.driver is not None:
                self.driver.fail(e)
            raise
        return int(t.item())

    def device_for(self, device: torch.device) -> torch.device:
        """The device this rank computes on: its own GPU under tensor parallelism."""
        if self.size > 1 and device.type == "cuda":
            return torch.device("cuda", self.rank % self.local_size)
        return device

    # ------------------------------------------------------------------ rank 0: drive the step

    def driving(self, step: StepInput) -> contextlib.AbstractContextManager:
        """Around rank 0's forward: send ``step`` to the other ranks first, and turn a collective
        failing inside into a ``TensorParallelError`` that names the rank that died."""
        if self.driver is None:
            return contextlib.nullcontext()
        return self._drive(step)

    @contextlib.contextmanager
    def _drive(self, step: StepInput) -> Iterator[None]:
        d = self.driver
        d.check()
        try:
            header, payload = step.pack()
            dist.broadcast(header, 0, group=self.cpu_group)
            dist.broadcast(payload, 0, group=self.cpu_group)
            yield
        except TensorParallelError:
            raise
        except BaseException as e:  # whatever broke (even Ctrl-C), the ranks are out of step now
            d.fail(e)  # an Exception becomes a TensorParallelError naming the rank that died
            raise

    def send_adapter(self, slot: int, name: str, path: str) -> None:
        """Rank 0: tell the workers to load a LoRA adapter (``LoraCommand``)."""
        if self.driver is None:
            return
        self.driver.check()
        data = json.dumps([name, path]).encode()
        try:
            dist.broadcast(_header(CMD_LORA, slot, len(data)), 0, group=self.cpu_group)
            dist.broadcast(torch.tensor(list(data), dtype=torch.int64), 0, group=self.cpu_group)
        except BaseException as e:
            self.driver.fail(e)
            raise

    def close(self) -> None:
        """Rank 0: stop the workers (a shutdown command, then signals) and leave the group."""
        if self.driver is not None:
            self.driver.close()

    # ------------------------------------------------------------------ workers: follow

    def recv_step(self) -> StepInput | LoraCommand | None:
        """A worker's wait for rank 0's next step (or adapter to load); None when told to shut down."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, _IDLE_TIMEOUT  # an idle engine sends nothing: no timeout here
        self.cpu_group.broadcast([header], opts).wait()
        h = header.tolist()
        if h[0] == CMD_SHUTDOWN:
            return None
        if h[0] == CMD_LORA:
            data = torch.empty(h[2], dtype=torch.int64)
            dist.broadcast(data, 0, group=self.cpu_group)
            name, path = json.loads(bytes(data.tolist()))
            return LoraCommand(h[1], name, path)
        payload = torch.empty(StepInput.payload_len(h), dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.cpu_group)
        return StepInput.unpack(h, payload)


def init_group(rank: int, size: int, store: dist.Store, backend: str, driver: Driver | None = None,
               local_size: int | None = None) -> TPGroup:
    """Join the default torch.distributed group (one tensor-parallel engine per process)."""
    if dist.is_initialized():
        raise ValueError("a tensor-parallel engine is already running in this process; close it first")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    if driver is not None:
        driver.cpu_group = cpu_group
    return TPGroup(rank, size, group, cpu_group, driver, local_size)


# ----------------------------------------------------------------------------- rank 0's workers


class Driver:
    """Rank 0's side of the group: its worker processes, their liveness, the shutdown."""

    def __init__(self, procs: list, on_close: Callable[[], None] | None = None, remote: str = ""):
        self.procs = procs  # multiprocessing.Process of ranks 1..L-1 (this node's), in rank order
        self.remote = remote  # the ranks on other nodes, in words ("" on one node): no waitpid for them...
        # ...but a connection each ("rank 2 on node 1" -> its socket), closed by its kernel when it dies: a
        # collective posted to a peer gloo already saw close can wait out its whole timeout instead of failing
        self.links: dict[str, socket.socket] = {}
        self._link_poll = select.poll()  # over the links, registered once (``link``)
        self.broken: str | None = None  # why the group cannot go on
        self.cpu_group = None
        self.store = None  # the rendezvous, kept alive with the group
        self._on_close = on_close
        self._closed = False

    def link(self, who: str, sock: socket.socket) -> None:
        """Watch ``who``'s connection (a rank on another node): ``dead`` polls it before every step."""
        self.links[who] = sock
        self._link_poll.register(sock, select.POLLIN)

    def dead(self) -> list[str]:
        """One line per worker that is gone (a cheap waitpid each; one poll over the remote ones)."""
        out = []
        for rank, p in enumerate(self.procs, start=1):
            code = p.exitcode
            if code is not None:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                out.append(f"tensor-parallel rank {rank} (pid {p.pid}) died ({how})")
        if self.links:
            ready = {fd for fd, _ in self._link_poll.poll(0)}
            out += [f"tensor-parallel {who} is gone (its connection to rank 0 closed)"
                    for who, sock in self.links.items() if sock.fileno() in ready and _closed(sock)]
        return out

    def fds(self) -> list[int]:
        """What becomes readable once a worker is gone: the local ones' sentinels, the remote ones' links."""
        return [p.sentinel for p in self.procs if p.pid is not None] + [s.fileno() for s in self.links.values()]

    def check(self) -> None:
        """Raise if a worker is gone or the group broke earlier: before a step, never a hang."""
        if self.broken is None:
            dead = self.dead()
            if dead:
                self._break("; ".join(dead))
        if self.broken is not None:
            raise TensorParallelError(f"{self.broken}; the engine cannot go on")

    def fail(self, error: BaseException) -> None:
        """A step failed: stop the group and, for an ``Exception``, raise a ``TensorParallelError``
        naming the rank that died (its exit gets a moment to show), or saying what failed."""
        if self.broken is None:
            deadline = time.monotonic() + (2.0 if isinstance(error, Exception) and (self.procs or self.links) else 0.0)
            while not (dead := self.dead()) and time.monotonic() < deadline:
                time.sleep(0.02)
            self._break("; ".join(dead) if dead else self._failed(error))
        if isinstance(error, Exception):
            raise TensorParallelError(f"{self.broken}; the engine cannot go on") from error

    def _failed(self, error: BaseException) -> str:
        if self.remote and isinstance(error, Exception):  # no local rank died: most likely a remote one
            return (f"a tensor-parallel step failed; a rank on another node ({self.remote}) is probably "
                    f"gone, see that node's log ({error!r})")
        return f"a tensor-parallel step failed: {error!r}"

    def _break(self, why: str) -> None:
        """The ranks are out of step for good: stop the workers left (they may sit in a collective)."""
        self.broken = why
        self.close(timeout=0.0)

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self.broken is None and self.cpu_group is not None and not self.dead():
            try:
                dist.broadcast(_header(CMD_SHUTDOWN), 0, group=self.cpu_group)
            except Exception:  # noqa: BLE001 - the signals below stop them anyway
                pass
        stop_processes(self.procs, timeout)
        for sock in self.links.values():
            sock.close()
        self.links.clear()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        if self._on_close is not None:
            self._on_close()


def _closed(sock: socket.socket) -> bool:
    """Whether the peer of readable ``sock`` has closed it (EOF or a reset); anything it sent (it sends
    nothing after its rank) is read and dropped, so that no byte left unread hides a close later."""
    try:
        return sock.recv(4096) == b""
    except OSError:
        return True


def stop_processes(procs: list, timeout: float) -> None:
    """Join, then SIGTERM, then SIGKILL: every process is gone when this returns."""
    procs = [p for p in procs if p.pid is not None]  # started ones
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
