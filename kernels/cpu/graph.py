"""CPU graphs: a forward recorded once as the C kernel calls and torch operators it ran, replayed
without the Python that chose them.

One decoded token of the default model is about 400 calls into ``kernels.cpu``'s C code; the
Python around them (modules, dispatch, argument checks, allocations) cost about as much as
the arithmetic. A recording keeps each call with its arguments (pointers included) and every
tensor the forward made, so the pointers stay valid; replaying it calls the same C functions
on the same memory and re-runs the torch operators (in place where they wrote in place, else
into the tensor they returned at recording). Its inputs are static tensors the caller refills
before each replay, as for a CUDA graph (``engine.step_buffers.DecodeGraphs``).

Every C function ``kernels.cpu.build.load`` declares is called through ``call``, so a kernel
is recorded without knowing it; torch operators are seen by a ``TorchDispatchMode``. Operators
that only allocate or make views are not redone (``contiguous`` and ``reshape`` are views by
their schema but copy when they must: those copies are redone).

What can be recorded: shapes, dtypes and Python-side choices are frozen (which kernel serves a
layer, the thread count a C call was given), so the forward must make the same decisions for any
data in its inputs. A read of a tensor on the host (``.item()``, ``int(t)``, any operator that
returns no tensor) is data-dependent and ends the recording with ``NotReplayable``; ``tolist()``
and ``numpy()`` are not seen at all, so a recorded forward must not use them. The kernels skip
their host-side checks of tensor contents while recording (``recording()``); the C functions'
own status checks still run at every replay. Recording is per thread: calls other threads make
meanwhile are theirs alone.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_NOTHING_TO_REDO = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                    _aten.new_empty.default, _aten.new_empty_strided.default}


class NotReplayable(RuntimeError):
    """The forward did something a replay could not repeat."""


class Recording(TorchDispatchMode):
    """While active (``with`` it, and on ``_active``), records the C calls and the torch operators run."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Callable[[], object]] = []
        self.held: list[object] = []  # every operator's tensors, which the steps' pointers may point into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.held.append((args, kwargs, out))
        if func._schema.is_mutable:  # it wrote into its arguments: do that again
            self.steps.append(functools.partial(_run, func, args, kwargs))
        elif not _tensors(out):
            raise NotReplayable(f"the forward read a value on the host ({func}): a replay could not repeat what "
                                "it decided with it")
        elif func not in _NOTHING_TO_REDO and not (func.is_view and _aliases(out, args)):
            # a new tensor, which later steps read: refill that one (``contiguous`` and ``reshape`` are
            # views by their schema, copies when they must)
            self.steps.append(functools.partial(_refill, out, func, args, kwargs))
        return out

    def replay(self) -> None:
        for step in self.steps:  # (a C function's status is checked by its own ``errcheck``, see build.load)
            step()


class _Active(threading.local):
    recordings: list[Recording]  # this thread's, innermost last: another thread's calls are never recorded

    def __init__(self) -> None:
        self.recordings = []


_active = _Active()


def _tensors(out) -> bool:
    return isinstance(out, torch.Tensor) or isinstance(out, (tuple, list)) and all(
        isinstance(o, torch.Tensor) for o in out)


def _aliases(out, args) -> bool:
    """Whether every tensor ``out`` holds lies in the memory of a tensor of ``args``."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outs = [out] if isinstance(out, torch.Tensor) else out
    return all(o.untyped_storage().data_ptr() in inputs for o in outs)


def _run(func, args, kwargs) -> None:
    func(*args, **kwargs)


def _refill(out, func, args, kwargs) -> None:
    new = func(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        out.copy_(new)
    else:
        for o, n in zip(out, new, strict=True):
            o.copy_(n)


def recording() -> bool:
    """Whether this thread is recording a forward (kernels then skip host reads of tensor contents)."""
    return bool(_active.recordings)


def call(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)`` (a C function), kept for the replay when recording."""
    result = fn(*args)
    if _active.recordings:
        _active.recordings[-1].steps.append(functools.partial(fn, *args))  # (which keeps the arguments)
    return result


def capture() -> Callable[[Callable[[], None]], Callable[[], None]]:
    """A ``DecodeGraphs`` capture: runs ``forward`` once (for real: its outputs are this call's) while
    recording it, and returns the recording's replay."""

    def record(forward: Callable[[], None]) -> Callable[[], None]:
        rec = Recording()
        _active.recordings.append(rec)
        try:
            with rec:
                forward()
        finally:
            _active.recordings.pop()
        return rec.replay

    return record
