"""CPU graphs: a forward recorded once as the C kernel calls and torch operators it ran, replayed
without the Python that chose them.

One decoded token of the default model is about 400 calls into ``kernels.cpu``'s C code; the
Python around them (modules, dispatch, argument checks, allocations) cost about as much as
the arithmetic. A recording keeps each call with its arguments (pointers included) and every
tensor the forward made, so the pointers stay valid; replaying it calls the same C functions
on the same memory and re-runs the torch operators (in place where they wrote in place, else
into the tensor they returned at recording). A run of C calls between two torch operators is
replayed by one call into ``graph.c``, which calls each kernel's packed twin from C. Its inputs are static tensors the caller refills
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

import ctypes
import functools
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_NOTHING_TO_REDO = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                    _aten.new_empty.default, _aten.new_empty_strided.default}


class NotReplayable(RuntimeError):
    """The forward did something a replay could not repeat."""


class Kernel(NamedTuple):
    """A C function of ``kernels.cpu``, as ``build.load`` declares it."""

    fn: Callable[..., object]  # the ctypes function (its errcheck checks its status)
    packed: int | None  # the address of its packed twin (packed.h), or None


class _Call:
    """A recorded C call: its kernel and arguments, and those packed as its packed twin reads them."""

    __slots__ = ("kernel", "args", "packed")

    def __init__(self, kernel: Kernel, args: tuple) -> None:
        self.kernel, self.args = kernel, args  # (the arguments kept: a struct passed by reference lives on)
        self.packed = None if kernel.packed is None else (ctypes.c_int64 * len(args))(
            *(_packed_value(t, a) for t, a in zip(kernel.fn.argtypes, args, strict=True)))

    def __call__(self) -> None:
        self.kernel.fn(*self.args)


def _packed_value(argtype, value) -> int:
    if argtype is ctypes.c_float:
        return struct.unpack("<i", struct.pack("<f", value))[0]
    if value is None or isinstance(value, int):
        return value or 0
    try:
        return ctypes.cast(value, ctypes.c_void_p).value or 0  # a pointer, or a struct passed by reference
    except ctypes.ArgumentError:
        raise TypeError(f"a recorded C call's argument {value!r} cannot be packed: pass ints, None, pointers "
                        "or byref()") from None


class _Run:
    """Consecutive recorded C calls, replayed by one call into graph.c."""

    def __init__(self, calls: list[_Call]) -> None:
        self.calls = calls
        self.fns = (ctypes.c_void_p * len(calls))(*(c.kernel.packed for c in calls))
        self.argv = (ctypes.c_void_p * len(calls))(*(ctypes.addressof(c.packed) for c in calls))
        self.failed = ctypes.c_int64(0)
        self.execute = _executor()

    def __call__(self) -> None:
        status = self.execute(len(self.calls), self.fns, self.argv, ctypes.byref(self.failed))
        if status:  # the failing call's own check says what went wrong
            call = self.calls[self.failed.value]
            check = getattr(call.kernel.fn, "errcheck", None)
            if check is not None:
                check(status, call.kernel.fn, call.args)
            raise RuntimeError(f"a replayed C kernel returned status {status}")


@functools.cache
def _executor() -> Callable[..., int] | None:
    """graph.c's ``replay_calls``, or None where it cannot be built (each call is then made from here)."""
    from kernels.cpu.build import load  # (build declares its functions through this module)

    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib = load("graph.c", {"replay_calls": [i64, p, p, p]}, restype=ctypes.c_int)
    if lib is None:
        return None
    return lib.replay_calls.args[0].fn  # the ctypes function itself: a replay is never recorded


class Recording(TorchDispatchMode):
    """While active (``with`` it, and on ``_active``), records the C calls and the torch operators run."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Callable[[], object]] = []
        self.held: list[object] = []  # every operator's tensors, which the steps' pointers may point into
        self._plan: list[Callable[[], object]] | None = None  # the steps, runs of C calls made one (``_Run``)

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
        if self._plan is None:
            self._plan = _plan(self.steps)
        for step in self._plan:  # (a C function's status is checked by its own ``errcheck``, see build.load)
            step()


def _plan(steps: list[Callable[[], object]]) -> list[Callable[[], object]]:
    """The steps, each run of C calls with packed twins made one ``_Run`` (where graph.c builds)."""
    if _executor() is None:
        return steps
    plan, run = [], []
    for step in [*steps, None]:
        if isinstance(step, _Call) and step.packed is not None:
            run.append(step)
            continue
        if run:
            plan.append(_Run(run) if len(run) > 1 else run[0])
            run = []
        if step is not None:
            plan.append(step)
    return plan


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


def hold(*tensors: torch.Tensor) -> None:
    """Keep these alive as long as the recording under way (a C call it keeps points into them)."""
    if _active.recordings:
        _active.recordings[-1].held.append(tensors)


def call(kernel: Kernel, *args: object) -> object:
    """``kernel.fn(*args)``, kept for the replay when recording."""
    result = kernel.fn(*args)
    if _active.recordings:
        _active.recordings[-1].steps.append(_Call(kernel, args))
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
