"""What every Triton launcher here shares: the argument checks it makes before
launching (a clear ``ValueError`` rather than garbage or a crash), and whether
the launch runs compiled or through Triton's interpreter.

The interpreter (``TRITON_INTERPRET=1``) runs the same kernels on CPU tensors,
slowly: it is how they are tested without a GPU. Triton reads the variable
when it is imported (its own library functions, ``tl.sum`` and kin, are
decorated then), so it must be set before anything imports triton:
``tests/conftest.py`` does so on machines without an NVIDIA driver.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


@functools.cache
def interpreting() -> bool:
    """Whether Triton kernels run through the interpreter in this process (fixed when triton was imported, as its
    own library functions were decorated; a launch asks several times: ~2 us each from triton's knobs)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_tensor(name: str, t: Any, ndim: int, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    """``t`` is a tensor of ``ndim`` dims and one of ``dtypes``, contiguous in its last dim, on a
    device Triton can launch on. (Every launch checks each of its tensors: the messages are made only for a
    tensor that fails. Building them always cost a decode attention launch 45 of its 81 us of host time.)"""
    if (isinstance(t, torch.Tensor) and t.dim() == ndim and t.dtype in dtypes and (t.shape[-1] <= 1 or t.stride(-1) == 1)
            and (t.device.type == "cuda" or interpreting())):
        return
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name} must be one of {', '.join(map(str, dtypes))}, got {t.dtype}")
    require(t.shape[-1] <= 1 or t.stride(-1) == 1,
            f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    require(t.device.type == "cuda" or interpreting(),
            f"{name} is on {t.device}: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set "
            f"before triton is imported to run on the CPU")


def check_same(what: str, names: Sequence[str], values: Sequence[Any]) -> None:
    first = values[0]
    for v in values:
        if v != first:
            raise ValueError(f"{', '.join(names)} must have the same {what}, got {', '.join(map(str, values))}")


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device: how many programs run at once, roughly."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << (n - 1).bit_length() if n > 1 else 1)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` without its ~2 us a call (a ``ConstexprFunction`` in triton >= 3.5: launchers call
    these a few times a launch, an eager step's launches a few hundred times)."""
    return -(-a // b)
