"""The device-side state of a step's inputs that outlives the step.

- ``BlockTables``: every running request's block table as a row of one persistent tensor,
  written only where it grew since the request's last step, so the host's work per step does
  not grow with the context held.
- ``Staging``: a step's integer inputs on their way to the device (on CUDA one pinned buffer,
  one asynchronous copy).
- ``DecodeGraphs``: decode-only forwards captured as CUDA graphs for the batch sizes of
  ``decode_buckets``, replayed over static inputs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, DecodeMetadata
from engine.request import Request


def ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class BlockTables:
    """Every running request's block table, as a row of one persistent (rows, max_blocks) tensor.

    A step writes only the blocks a request's table gained since its last step; all of them for a
    request new here or whose table was replaced (preemption frees it: ``BlockManager.free`` sets a
    new list). Rows go to requests as they come, and back, least recently used first, when needed:
    a step holds at most ``num_rows`` requests, so a row taken is never one of the step's. The row
    past them holds only the scratch block, for the padding sequences of decode steps."""

    def __init__(self, num_rows: int, max_blocks: int, scratch_block: int, device: torch.device):
        self.table = torch.zeros(num_rows + 1, max_blocks, dtype=torch.int64, device=device)
        self.table[num_rows] = scratch_block
        self.scratch_row, self.scratch_block = num_rows, scratch_block
        self._free = list(range(num_rows))
        # request id -> (row, its block_table list as last seen, blocks written); least recently used first
        self._held: OrderedDict[str, tuple[int, list[int], int]] = OrderedDict()

    def update(self, reqs: list[Request]) -> tuple[list[int], list[int], list[int]]:
        """The rows of ``reqs``, and the writes (flat index, block id) that bring them up to date."""
        held, width = self._held, self.table.shape[1]
        for r in reqs:  # first out of reach of the reclaiming below
            if r.request_id in held:
                held.move_to_end(r.request_id)
        rows, write_at, write_ids = [], [], []
        for r in reqs:
            row, table, written = held.get(r.request_id, (-1, None, 0))
            if table is not r.block_table:
                if row < 0:
                    row = self._free.pop() if self._free else held.popitem(last=False)[1][0]
                written = 0
            new = r.block_table[written:]
            start = row * width + written
            write_at.extend(range(start, start + len(new)))
            write_ids.extend(new)
            held[r.request_id] = (row, r.block_table, len(r.block_table))
            rows.append(row)
        return rows, write_at, write_ids

    def write(self, at: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.table.view(-1)[at] = ids
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
    """Decode-only forwards captured once per batch size of ``sizes`` (by ``capture``: as CUDA
    graphs) over static inputs: a step of one of these sizes copies its inputs in and replays.

    The graphs attend up to ``max_model_len`` (their block tables are that wide): the decode
    kernel reads a sequence's blocks only up to its length, whatever the bound. At capture every
    row is a one-token sequence on the scratch block; afterwards a step fills all the rows its
    graph reads (its padding rows included: ``ModelRunner._pad``)."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_model_len: int, max_blocks: int,
                 scratch_block: int, block_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, capture: Capture):
        n, i64 = sizes[-1], dict(dtype=torch.int64, device=device)
        self.input_ids, self.positions = torch.zeros(n, **i64), torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, **i64)
        self.decode = DecodeMetadata(torch.arange(n, **i64), torch.full((n, max_blocks), scratch_block, **i64),
                                     torch.ones(n, **i64), max_model_len)
        self.hidden = torch.empty(n, hidden_size, dtype=dtype, device=device)
        self.replays: dict[int, Callable[[], None]] = {}
        for b in reversed(sizes):  # the largest first: the others fit in its memory
            d = self.decode
            meta = AttentionMetadata(self.slot_mapping[:b], DecodeMetadata(
                d.token_rows[:b], d.block_tables[:b], d.seq_lens[:b], max_model_len), None)

            def forward(b: int = b, meta: AttentionMetadata = meta) -> None:
                self.hidden[:b] = model(self.input_ids[:b], self.positions[:b], meta)

            forward()  # once outside the graph: kernels compile, lazy state settles
            self.replays[b] = capture(forward)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The (B, hidden) final hidden states of a decode-only step of B sequences (B one of the sizes)."""
        b, d, s = len(input_ids), meta.decode, self.decode
        self.input_ids[:b] = input_ids
        self.positions[:b] = positions
        self.slot_mapping[:b] = meta.slot_mapping
        s.token_rows[:b] = d.token_rows
        s.seq_lens[:b] = d.seq_lens
        s.block_tables[:b, :d.block_tables.shape[1]] = d.block_tables
        self.replays[b]()
        return self.hidden[:b]
