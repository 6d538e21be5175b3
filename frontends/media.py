"""Where a request's images come from: ``data:`` URLs always; ``http(s)://`` URLs of the domains the server was
started with (vLLM's ``--allowed-media-domains``; ``*``: any) and ``file://`` URLs under a folder it names
(``--allowed-local-media-path``). Without those flags the server fetches nothing on a client's word: a URL
can make a server call its own private network, so that is the operator's choice, not a default.

Fetches run on a few threads of their own (never the tokenizer's), redirects are followed only to allowed
domains, each is bounded by ``MAX_IMAGE_BYTES`` and ``FETCH_SECONDS``; every failure is an ``ImageError``,
a 400 naming the URL's host.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from frontends.images import MAX_IMAGE_BYTES, ImageError

FETCH_SECONDS = 10.0  # one image's fetch, connection to last byte
FETCH_THREADS = 4
_DATA_URL = re.compile(r"data:image/[\w.+-]+(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.ASCII)


@dataclass(frozen=True)
class MediaSources:
    domains: tuple[str, ...] = ()  # hosts http(s) images may come from ("*": any); none: no fetching
    local_path: str | None = None  # file:// images from under this folder; None: none


class MediaReader:
    """A URL's bytes: ``read`` (a coroutine)."""

    def __init__(self, sources: MediaSources = MediaSources()):
        self.domains = frozenset(d.lower() for d in sources.domains)
        self.local_path = os.path.realpath(sources.local_path) if sources.local_path else None
        self._pool: ThreadPoolExecutor | None = None

    async def read(self, url: str) -> bytes:
        if not isinstance(url, str):
            raise ImageError("an image's url must be a string")
        if url.startswith("data:"):
            return data_bytes(url)
        scheme = url.split(":", 1)[0].lower()
        if scheme in ("http", "https"):
            self._check_host(url)
            work = self._fetch
        elif scheme == "file":
            if self.local_path is None:
                raise ImageError("file:// images are not read here (the server was not started with "
                                 "--allowed-local-media-path): send the image as a data:image/...;base64, URL")
            work = self._file
        else:
            raise ImageError(f"images come as data:image/...;base64, URLs here, got {url[:24]!r}")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="media")
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, work, url), FETCH_SECONDS + 1)
        except TimeoutError:
            raise ImageError(f"fetching an image from {_host(url)} took longer than {FETCH_SECONDS:g} s") from None

    def _check_host(self, url: str) -> None:
        host = _host(url)
        if "*" in self.domains or host in self.domains:
            return
        if not self.domains:
            raise ImageError("images are not fetched from URLs here (the server was not started with "
                             "--allowed-media-domains): send the image as a data:image/...;base64, URL")
        raise ImageError(f"images are fetched only from {', '.join(sorted(self.domains))} here, not {host}")

    def _fetch(self, url: str) -> bytes:
        """``url``'s body, read a piece at a time against the deadline (a server dripping bytes holds a thread
        ``FETCH_SECONDS`` and a socket timeout at most)."""
        deadline = time.monotonic() + FETCH_SECONDS
        opener = urllib.request.build_opener(_Redirects(self._check_host))
        request = urllib.request.Request(url, headers={"User-Agent": "tokenmill", "Accept": "image/*"})
        data = bytearray()
        try:
            with opener.open(request, timeout=FETCH_SECONDS / 4) as r:
                while piece := r.read(1 << 16):
                    data += piece
                    if len(data) > MAX_IMAGE_BYTES:
                        raise ImageError(f"an image may be at most {MAX_IMAGE_BYTES >> 20} MiB")
                    if time.monotonic() > deadline:
                        raise ImageError(f"fetching an image from {_host(url)} took longer than {FETCH_SECONDS:g} s")
        except ImageError:
            raise
        except urllib.error.HTTPError as e:
            raise ImageError(f"fetching an image from {_host(url)} gave HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ImageError(f"cannot fetch an image from {_host(url)}: {getattr(e, 'reason', e)}") from None
        return bytes(data)

    def _file(self, url: str) -> bytes:
        path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
        if os.path.commonpath([path, self.local_path]) != self.local_path:
            raise ImageError("file:// images are read only from under the server's --allowed-local-media-path")
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
            if regular:  # (a FIFO or a device would block, or never end)
                with open(path, "rb") as f:
                    data = f.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise ImageError(f"cannot read the image file: {e.strerror}") from None
        if not regular:
            raise ImageError("a file:// image must be a regular file")
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(f"an image may be at most {MAX_IMAGE_BYTES >> 20} MiB")
        return data


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed only to http(s) URLs of allowed hosts."""

    def __init__(self, check) -> None:
        self.check = check

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise ImageError(f"an image's URL redirects to {newurl[:24]!r}")
        self.check(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def data_bytes(url: str) -> bytes:
    """A ``data:image/...;base64,`` URL's bytes."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageError(f"an image's data URL must be data:image/...;base64, got {url[:24]!r}")
    if (len(url) - m.end()) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ImageError(f"an image may be at most {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        return base64.b64decode(url[m.end():], validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image's data URL is not valid base64") from None


def _host(url: str) -> str:
    try:
        return (urllib.parse.urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""
