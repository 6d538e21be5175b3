"""tokenmill's cache folder, kept across runs: the compiled CPU kernels (``kernels/cpu/build.py``) and the
tokenizers the frontends read without transformers (``frontends/tokenizer.py``). Torch-free: the launcher and
the frontends use it.

The folder is ``$TOKENMILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenmill`` or ``~/.cache/tokenmill``, else one
in the temp folder: the first that can be made, is writable, and is private (what another user could plant
there is never read).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from importlib import metadata
from pathlib import Path


def cache_dir() -> Path:
    for d in (os.environ.get("TOKENMILL_CACHE_DIR"),
              os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"),
              os.path.join(tempfile.gettempdir(), f"tokenmill-{os.getuid() if hasattr(os, 'getuid') else 0}")):
        if not d:
            continue
        d = os.path.abspath(os.path.expanduser(d))  # (a relative one names the same folder from any directory)
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            if os.access(d, os.W_OK) and private(d):
                return Path(d)
        except OSError:
            continue
    raise OSError("no writable private cache folder (set TOKENMILL_CACHE_DIR)")


def private(d: str) -> bool:
    """Ours and writable by nobody else."""
    st = os.stat(d)
    return not hasattr(os, "getuid") or (st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def tokenizer_cache_dir(path: str) -> str | None:
    """Where the frontends keep the tokenizer of ``path`` (a model folder or a ``.gguf`` file) as it is now: named
    from its path, the size and time of each file in it, and the transformers and tokenizers that read it, so an
    edit of any of them, or an upgrade, saves it afresh. None where ``path`` is not on disk or there is no cache
    folder (each run then reads it once with transformers)."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        return None
    try:  # (a file's folder: transformers reads a tokenizer_config.json beside a GGUF too)
        folder = os.path.isdir(path)
        files = sorted(_stats(path if folder else os.path.dirname(path), deep=folder))
        versions = [metadata.version(p) for p in ("transformers", "tokenizers")]
        root = cache_dir()
    except (OSError, metadata.PackageNotFoundError):
        return None
    key = hashlib.sha256(repr((path, files, versions)).encode()).hexdigest()[:16]
    return str(root / TOKENIZERS / key)


TOKENIZERS = "tokenizers"  # (the cache folder's folder of them)


def _stats(folder: str, deep: bool) -> list[tuple]:
    """Each file's path in ``folder`` (its subfolders' too where ``deep``: additional_chat_templates/...), size,
    and times of change (a copy that keeps the modification time still has a change time of its own)."""
    out = []
    for root, _dirs, names in os.walk(folder):
        for name in names:
            st = os.stat(os.path.join(root, name))
            out.append((os.path.relpath(os.path.join(root, name), folder), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        if not deep:
            break
    return out
