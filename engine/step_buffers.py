"""The device-side state of a step's inputs that outlives the step.

- ``BlockTables``: every running request's block table as a row of one persistent tensor,
  written only where it grew since the request's last step, so the host's work per step does
  not grow with the context held.
- ``Staging``: a step's integer inputs on their way to the device (on CUDA one pinned buffer,
  one asynchronous copy).
- ``DecodeGraphs``: decode-only forwards captured as CUDA graphs for the batch sizes of
  ``decode_buckets`` (or on the CPU recorded as their kernel calls, ``kernels.cpu.graph``),
  replayed over static inputs.
- ``PromptGraphs``: on CUDA, steps with prompt tokens (and decodes beside them) captured for the
  token counts of ``prompt_buckets``, where one prefill launch a layer takes the whole step.
"""

from __future__ import annotations

import functools
import logging
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np
import torch

from engine.attention import StepIndex, ints, prefill_index
from engine.request import Request

log = logging.getLogger("tokenmill.engine")


class BlockTables:
    """Every running request's block table, as a row of one persistent (rows, max_blocks) tensor.

    A step writes only the blocks a request's table gained since its last step; all of them for a
    request new here or whose table was replaced (preemption frees it: ``BlockManager.free`` sets a
    new list). Rows go to requests as they come, and back, least recently used first, when needed:
    a step holds at most ``num_rows`` requests, so a row taken is never one of the step's. The row
    past them holds only the scratch block, for the padding sequences of decode steps.

    With a sliding-window pool (``engine.window_blocks``) the same tensor holds, after the tables,
    ``window_map``: each block's window block (``scratch_window_block`` until it has one), written as
    the tables are, with the links the block manager made for the step (so that tensor-parallel ranks
    get them in the same writes)."""

    def __init__(self, num_rows: int, max_blocks: int, scratch_block: int, device: torch.device,
                 scratch_window_block: int | None = None):
        n = (num_rows + 1) * max_blocks
        map_len = scratch_block + 1 if scratch_window_block is not None else 0
        self.storage = torch.zeros(n + map_len, dtype=torch.int64, device=device)
        self.table = self.storage[:n].view(num_rows + 1, max_blocks)
        self.window_map = self.storage[n:].fill_(scratch_window_block) if map_len else None
        self.table[num_rows] = scratch_block
        self.scratch_row, self.scratch_block = num_rows, scratch_block
        # each row's request's last sampled token, kept on the device (``ModelRunner.feeds_next_step``): the
        # input of its next decode, launched before that token is known
        self.last_tokens = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        self._free = list(range(num_rows))
        # request id -> (row, its block_table list as last seen, blocks written)
        self._held: dict[str, tuple[int, list[int], int]] = {}

    def update(self, reqs: list[Request], window_writes: list[tuple[int, int]] = ()) -> tuple[
            list[int], list[int], list[int]]:
        """The rows of ``reqs``, and the writes (flat index, block id) that bring them, and the window
        map (``window_writes``: block, window block), up to date."""
        held = self._held
        rows, write_at, write_ids, new = [], [], [], []
        for i, r in enumerate(reqs):
            got = held.get(r.request_id)
            if got is None:
                new.append(i)
                rows.append(-1)
                continue
            row, table, written = got
            rows.append(row)
            if table is not r.block_table:  # replaced (preempted and readmitted): written again
                self._write(r, row, 0, write_at, write_ids)
            elif written < len(table):  # (most decode steps: no block gained)
                self._write(r, row, written, write_at, write_ids)
        if len(new) > len(self._free):  # rows are reclaimed from every request not in this step (the runner
            # is not told who left; one that comes back gets a row again, written whole)
            stepping = {r.request_id for r in reqs}
            for request_id in [k for k in held if k not in stepping]:
                self._free.append(held.pop(request_id)[0])
        for i in new:
            rows[i] = self._free.pop()
            self._write(reqs[i], rows[i], 0, write_at, write_ids)
        for block, window_block in window_writes:
            write_at.append(self.table.numel() + block)
            write_ids.append(window_block)
        return rows, write_at, write_ids

    def _write(self, r: Request, row: int, written: int, write_at: list[int], write_ids: list[int]) -> None:
        """The writes of ``r``'s blocks from its ``written``-th on, into ``row``."""
        start = row * self.table.shape[1] + written
        write_at.extend(range(start, start + len(r.block_table) - written))
        write_ids.extend(r.block_table[written:])
        self._held[r.request_id] = (row, r.block_table, len(r.block_table))

    def write(self, at: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.storage[at] = ids
        return self.table


class Staging:
    """A step's integer inputs on their way to the device. On CUDA: one pinned host buffer, one
    asynchronous copy into one device buffer, views of it handed out; the host buffer is reused
    once that copy is done (an event says so). On the CPU the tensors stay as they are."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.host = self.dev = torch.empty(0, dtype=torch.int64)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.copied is None:
            return tensors
        sizes = [t.numel() for t in tensors.values()]
        n = sum(sizes)
        self.copied.synchronize()  # the last step's copy has left the host buffer
        if n > self.host.numel():
            self.host = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
            self.dev = torch.empty(2 * n, dtype=torch.int64, device=self.device)
        torch.cat([t.reshape(-1) for t in tensors.values()], out=self.host[:n])
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        self.copied.record()
        parts = self.dev[:n].split(sizes)
        return {k: part.view(t.shape) for (k, t), part in zip(tensors.items(), parts, strict=True)}


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes decode steps are padded to (as vLLM's): 1, 2, 4, 8, 16, every 32, and max_num_seqs."""
    return [b for b in (1, 2, 4, 8, 16) if b < max_num_seqs] + list(range(32, max_num_seqs, 32)) + [max_num_seqs]


Capture = Callable[[Callable[[], None]], Callable[[], None]]  # a forward in, its replay out


def cuda_graph_capture() -> Capture:
    """Captures forwards as CUDA graphs (each returned as its ``replay``), all in one memory pool."""
    pool = None

    def capture(forward: Callable[[], None]) -> Callable[[], None]:
        nonlocal pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            forward()
        pool = graph.pool()
        return graph.replay

    return capture


class DecodeGraphs:
    """Decode-only forwards captured per batch size (by ``capture``: as CUDA graphs, or as CPU
    graphs, ``kernels.cpu.graph``) over static inputs: a step of a captured size copies its inputs
    in (each row's token, position and row of the persistent block tables: one buffer a size, in
    one copy) and replays. The graph makes the step's attention metadata itself (slot mapping, block
    tables, lengths) and takes the tokens still in flight from their rows' ``last_tokens`` (``in_flight``:
    under asynchronous scheduling only, the one mode with such tokens): outside it, a step launches only
    that copy and its block tables' write.

    CUDA: every size of ``sizes`` is captured at start-up (the largest first: the others fit in
    its memory pool) and steps are padded to one of them (``ModelRunner._pad``). CPU (``lazy``):
    a size is captured by the first step of that size, whose forward the capture runs for real,
    so no step is padded and none is computed twice; recordings hold their own intermediates,
    so those of at most ``max_rows`` rows in all are kept, the least recently used dropped. A step
    whose forward takes another path (``variant``: with LoRA adapters, how many slots it computes)
    has recordings of its own.

    The graphs attend up to ``max_model_len`` (their block tables are that wide): the decode
    kernel reads a sequence's blocks only up to its length, whatever the bound. Their rows are
    the batch's own order (sequence i in row i, as the step's tokens), so that attention needs
    no reordering of q. At a start-up capture every row is a one-token sequence on the scratch
    block; afterwards a step fills all the rows its graph reads (its padding rows included)."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_model_len: int, tables: BlockTables,
                 block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device, capture: Capture,
                 lazy: bool = False, max_rows: int = 0, variant: Callable[[], Hashable] | None = None,
                 in_flight: bool = True):
        n, i64 = sizes[-1], dict(dtype=torch.int64, device=device)
        self.model, self.capture, self.max_model_len, self.block_size = model, capture, max_model_len, block_size
        self.in_flight = in_flight  # whether a token may be in flight (asynchronous scheduling): else none is read
        self.tables = tables  # (persistent: the graphs read the step's rows of its tables, and its window map)
        self.sizes, self.max_rows, self.variant = set(sizes), max_rows, variant
        # each size's inputs (inputs_of), (3, b): each row's token, cached tokens and row of the tables (at a
        # start-up capture: the scratch row's)
        self.inputs = {b: torch.stack([torch.zeros(b, **i64), torch.zeros(b, **i64),
                                       torch.full((b,), tables.scratch_row, **i64)]) for b in sizes}
        self.token_rows = torch.arange(n, **i64)
        self.hidden = torch.empty(n, hidden_size, dtype=dtype, device=device)
        self.replays: OrderedDict[tuple[int, Hashable], Callable[[], None]] = OrderedDict()  # (size, variant)
        if not lazy:
            for b in reversed(sizes):
                self._forward(b)  # once outside the graph: kernels compile, lazy state settles
                self.replays[b, self._variant()] = capture(functools.partial(self._forward, b))

    @staticmethod
    def inputs_of(token_ids: list[int], query_lens: list[int], computed_lens: list[int],
                  table_rows: list[int]) -> torch.Tensor:
        """A decode step's inputs as ``replay`` takes them (flat, its tokens, positions and table rows)."""
        return ints(token_ids + computed_lens + table_rows)

    def _forward(self, b: int) -> None:
        """The forward of ``b`` rows, its metadata included: a replay makes the step's slot mapping, block
        tables and lengths from its positions and table rows, and takes the tokens still in flight (-1)
        from their rows' ``last_tokens``, with no launch of its own outside the graph."""
        ids, pos, rows = self.inputs[b]
        index = StepIndex({"positions": pos, "token_table_rows": rows, "decode_token_rows": self.token_rows[:b],
                           "decode_table_rows": rows, "decode_seq_lens": pos + 1}, max_decode_len=self.max_model_len,
                          max_prefill_len=0, mixed=False, decode_in_order=True)
        _, meta = index.metadata(self.tables.table, self.block_size, self.tables.window_map)
        if self.in_flight:
            ids = torch.where(ids < 0, self.tables.last_tokens[rows], ids)
        self.hidden[:b] = self.model(ids, pos, meta)

    def _variant(self) -> Hashable:
        return self.variant() if self.variant is not None else None

    def serves(self, b: int) -> bool:
        return b in self.sizes  # (the captured sizes are among them)

    def replay(self, inputs: torch.Tensor, b: int) -> torch.Tensor:
        """The (B, hidden) final hidden states of a decode-only step of B sequences (``serves(B)``), in the
        step's order, from its ``inputs_of`` (on the device)."""
        self.inputs[b].view(-1).copy_(inputs)
        key = b, self._variant()
        replay = self.replays.get(key)
        if replay is not None:
            self.replays.move_to_end(key)
            replay()
            return self.hidden[:b]
        while self.replays and sum(size for size, _ in self.replays) + b > self.max_rows:
            self.replays.popitem(last=False)
        try:
            self.replays[key] = self.capture(functools.partial(self._forward, b))
        except Exception as e:  # noqa: BLE001 - a forward that cannot be recorded still runs, eagerly from now on
            self._forward(b)  # what the capture left half done, again: a failure of the forward raises here
            log.warning("decode graphs off: a step of %d could not be captured (%s: %s)", b, type(e).__name__, e)
            self.sizes.clear()
            self.replays.clear()
        return self.hidden[:b]


def prompt_buckets(max_tokens: int) -> list[int]:
    """The token counts steps with prompt tokens are padded to: 16, 24, 32, 48, 64, 96... (powers of two and
    halfway between: a third of a step at most is padding) below ``max_tokens``, then ``max_tokens``."""
    sizes, n = [], 16
    while n < max_tokens:
        sizes.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n // 3 * 4
    return sizes + [max_tokens]


class PromptGraphs:
    """Steps with prompt tokens (prompt chunks, with or without decodes beside them) captured per token count
    (``sizes``, the largest first, all in one memory pool) where one prefill launch a layer takes the whole step
    (``kernels.prefill_takes_decodes``: Triton's, whose grid depends only on the numbers of tokens and sequences):
    at start-up on CUDA, so that such a step costs its inputs' copy and a replay, not a few hundred launches.

    A step of T tokens and B sequences (T at most ``sizes[-1]``, B below ``max_seqs``) is padded to the next size
    N with one more sequence of N - T tokens that write and read only the scratch block (its row of the tables is
    the scratch row: positions 0..N-T-1 at its slots, finite numbers in every row, attended by nobody else), then
    with empty sequences up to ``max_seqs`` (no queries, no keys: their programs do nothing). Its inputs, padded on
    the host (``inputs_of``), come in one copy; the graph makes the slot mapping and the block tables from them,
    and takes the tokens still in flight (-1) from their rows' ``last_tokens``, as decode's do. The graphs attend
    up to ``max_model_len``, as decode's; their block tables are that wide, read only as far as each sequence goes."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_seqs: int, max_model_len: int,
                 tables: BlockTables, block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 capture: Capture, in_flight: bool = True):
        self.model, self.sizes, self.max_seqs, self.max_model_len = model, sizes, max_seqs, max_model_len
        self.tables, self.block_size, self.in_flight = tables, block_size, in_flight  # (as DecodeGraphs')
        # each size's inputs (inputs_of): tokens, positions and table rows (N each), then each sequence's
        # table row, length (M each) and first token (M + 1)
        self.inputs = {n: torch.zeros(3 * n + 3 * max_seqs + 1, dtype=torch.int64, device=device) for n in sizes}
        self.hidden = torch.empty(sizes[-1], hidden_size, dtype=dtype, device=device)
        self.replays: dict[int, Callable[[], None]] = {}
        for size in reversed(sizes):  # (each captured as a step of the padding sequence alone)
            self.inputs[size].copy_(self._padded([], [], [], [], size))
            self._forward(size)  # once outside the graph: kernels compile, lazy state settles
            self.replays[size] = capture(functools.partial(self._forward, size))

    def inputs_of(self, token_ids: list[int], query_lens: list[int], computed_lens: list[int],
                  table_rows: list[int]) -> torch.Tensor:
        """A step's inputs as ``replay`` takes them (flat; padded to the next size, ``serves``)."""
        n = self.sizes[bisect_left(self.sizes, len(token_ids))]
        return self._padded(token_ids, query_lens, computed_lens, table_rows, n)

    def _padded(self, token_ids: list[int], query_lens: list[int], computed_lens: list[int], table_rows: list[int],
                n: int) -> torch.Tensor:
        t, b, m, scratch = len(token_ids), len(query_lens), self.max_seqs, self.tables.scratch_row
        positions, token_rows, seq_lens, start = prefill_index(query_lens, computed_lens, table_rows)
        out = np.empty(3 * n + 3 * m + 1, dtype=np.int64)  # its parts, in order:
        ids, pos, rows, seq_rows, lens, starts = np.split(out, [n, 2 * n, 3 * n, 3 * n + m, 3 * n + 2 * m])
        ids[:t], ids[t:] = token_ids, 0
        pos[:t], pos[t:] = positions, np.arange(n - t)  # (the padding sequence's, on the scratch block)
        rows[:t], rows[t:] = token_rows, scratch
        seq_rows[:b], seq_rows[b:] = table_rows, scratch  # (the padding sequence's and the empty ones')
        lens[:b], lens[b], lens[b + 1:] = seq_lens, n - t, 0
        starts[:b + 1], starts[b + 1:] = start, n
        return torch.from_numpy(out)

    def _forward(self, n: int) -> None:
        m = self.max_seqs
        ids, pos, token_rows, seq_rows, seq_lens, start = self.inputs[n].split([n, n, n, m, m, m + 1])
        index = StepIndex({"positions": pos, "token_table_rows": token_rows, "prefill_table_rows": seq_rows,
                           "prefill_seq_lens": seq_lens, "prefill_query_start": start}, max_decode_len=0,
                          max_prefill_len=self.max_model_len, mixed=False, decode_in_order=False)
        _, meta = index.metadata(self.tables.table, self.block_size, self.tables.window_map)
        if self.in_flight:
            ids = torch.where(ids < 0, self.tables.last_tokens[token_rows], ids)
        self.hidden[:n] = self.model(ids, pos, meta)

    def serves(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a step of ``num_tokens`` in ``num_seqs`` sequences (one prefill over all of them) replays:
        few enough of both."""
        return num_tokens <= self.sizes[-1] and num_seqs < self.max_seqs

    def replay(self, inputs: torch.Tensor, t: int) -> torch.Tensor:
        """The (T, hidden) final hidden states of a step of T tokens (``serves``), from its ``inputs_of`` (on
        the device)."""
        n = (len(inputs) - 3 * self.max_seqs - 1) // 3
        self.inputs[n].copy_(inputs)
        self.replays[n]()
        return self.hidden[:t]
