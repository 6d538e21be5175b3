"""Builds a C source beside this file into a shared library, once per machine, and loads it.

The library lands in tokenmill's cache folder (``engine/cache_dir.py``: ``$TOKENMILL_CACHE_DIR``, else
``~/.cache/tokenmill``...) under a name hashed from the source (and the headers beside it), the
compiler, its flags and this CPU (``-march=native``), so an edit or another machine builds
afresh and concurrent processes never load a half-written file. Compiling takes about a
second. Flags are tried from the best down (OpenMP and native instructions, then without),
and where no C compiler works at all ``load`` returns None and logs why once: callers then
use the reference kernels. The functions ``load`` declares are recorded when called during the
capture of a CPU graph (``graph``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from engine.cache_dir import cache_dir
from kernels.cpu import graph

log = logging.getLogger("tokenmill.kernels")

FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-march=native", "-fopenmp-simd"],
    ["-O3"],
)


def _compiler() -> list[str] | None:
    """The C compiler's command line (``$CC`` may carry words of its own: ``ccache gcc``)."""
    for cc in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        words = shlex.split(cc) if cc else []
        if words and shutil.which(words[0]):
            return words
    return None


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


def load(source: str, functions: dict[str, list] | None = None, restype=None,
         errcheck=None) -> SimpleNamespace | None:
    """The library built from ``source`` (a file name beside this module), its ``functions``
    (name -> argument ctypes; each returns ``restype``, None: nothing, checked by ctypes'
    ``errcheck`` if given, at every call and replay) declared, or None with a warning when it
    cannot be built or loaded here."""
    src = Path(__file__).with_name(source)
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found (set CC): the CPU kernels in %s fall back to the reference", source)
        return None
    text = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))  # and its headers
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([text, " ".join(cc).encode(), " ".join(flags).encode(), _cpu_id().encode()]))
        try:
            lib = cache_dir() / f"{src.stem}-{key.hexdigest()[:16]}.so"
            if not lib.exists():
                _compile(cc, flags, src, lib)
            return _declare(ctypes.CDLL(str(lib)), functions or {}, restype, errcheck)
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{' '.join(cc + flags)}: {str(e).strip()[-300:]}")
    log.warning("could not build %s, the CPU kernels fall back to the reference:\n%s", source, "\n".join(errors))
    return None


def status_check(what: str) -> Callable[..., int]:
    """A ctypes ``errcheck`` for C functions that return a status (packed.h's codes): 0, or 1 (out of
    memory), or 3 (an index given in a tensor, e.g. a K/V slot, outside what it indexes), or another value
    (arguments the function refused, which its Python caller never sends); nothing is written unless 0."""

    def check(status: int, func=None, args=None) -> int:
        if status == 1:
            raise MemoryError(f"{what} could not allocate its buffers")
        if status == 3:
            raise IndexError(f"{what} was given an index out of range (a slot past the KV cache)")
        if status:
            raise ValueError(f"{what} refused its arguments (status {status})")
        return status

    return check


def _declare(lib: ctypes.CDLL, functions: dict[str, list], restype, errcheck) -> SimpleNamespace:
    """The declared functions, each recorded when called during a CPU graph's capture (``graph.call``),
    with its packed twin (``NAME_packed``, see packed.h) where the library has one."""
    out = SimpleNamespace()
    for name, argtypes in functions.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
        if errcheck is not None:
            fn.errcheck = errcheck
        packed = getattr(lib, f"{name}_packed", None)
        kernel = graph.Kernel(fn, None if packed is None else ctypes.cast(packed, ctypes.c_void_p).value)
        setattr(out, name, functools.partial(graph.call, kernel))
    return out


def _compile(cc: list[str], flags: list[str], src: Path, lib: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        res = subprocess.run([*cc, *flags, "-shared", "-fPIC", "-o", tmp, str(src), "-lm"],
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise OSError(res.stderr or f"exit status {res.returncode}")
        with open(tmp, "rb") as f:  # on disk before its name is: a crash leaves no truncated library
            os.fsync(f.fileno())
        os.replace(tmp, lib)  # atomic: another process sees the whole library or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
