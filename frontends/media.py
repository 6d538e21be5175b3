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
import http.client
import os
import re
import socket
import stat
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from frontends.images import MAX_IMAGE_BYTES, ImageError

FETCH_SECONDS = 10.0  # one image's fetch, connection to last byte
FETCH_THREADS = 4
MAX_REDIRECTS = 5
_DATA_URL = re.compile(r"data:image/[\w.+-]+(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.ASCII | re.IGNORECASE)


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
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            return data_bytes(url)
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
        # (each fetch ends by its own deadline, counted from when a thread takes it; a request's fetches not
        # started yet are dropped when another of them fails: asyncio.gather's caller cancels them)
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, url)

    def _check_host(self, url: str) -> None:
        host = _host(url)
        if "*" in self.domains or host in self.domains:
            return
        if not self.domains:
            raise ImageError("images are not fetched from URLs here (the server was not started with "
                             "--allowed-media-domains): send the image as a data:image/...;base64, URL")
        raise ImageError(f"images are fetched only from {', '.join(sorted(self.domains))} here, not {host}")

    def _fetch(self, url: str) -> bytes:
        """``url``'s body: redirects followed to allowed hosts only (at most ``MAX_REDIRECTS``), the whole
        exchange, headers and all, cut off ``FETCH_SECONDS`` after it starts (the socket is shut from a timer:
        a server dripping bytes cannot hold the thread longer)."""
        deadline = time.monotonic() + FETCH_SECONDS
        host = _host(url)
        try:
            for _ in range(MAX_REDIRECTS + 1):
                status, location, body = _get(url, deadline)
                if location is None:
                    if status != 200:
                        raise ImageError(f"fetching an image from {host} gave HTTP {status}")
                    return body
                url = urllib.parse.urljoin(url, location)
                if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                    raise ImageError(f"an image's URL redirects to {url[:24]!r}")
                self._check_host(url)
        except ImageError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the peer or the URL makes http.client raise
            if time.monotonic() >= deadline:
                raise ImageError(f"fetching an image from {host} took longer than {FETCH_SECONDS:g} s") from None
            raise ImageError(f"cannot fetch an image from {host}: {type(e).__name__}: {e}"[:300]) from None
        raise ImageError(f"an image's URL redirects more than {MAX_REDIRECTS} times")

    def _file(self, url: str) -> bytes:
        parts = urllib.parse.urlsplit(url)
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or "\0" in path:
            raise ImageError("a file:// image URL names a local path (file:///path)")
        path = os.path.realpath(path)
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
        return _at_most_max(len(data), data)


def _get(url: str, deadline: float) -> tuple[int, str | None, bytes]:
    """One GET: (status, the redirect's Location or None, the body of a 200), within ``deadline``."""
    parts = urllib.parse.urlsplit(url)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=remaining)
    timer = None
    try:
        conn.connect()
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (conn.sock,))
        timer.start()
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"User-Agent": "tokenmill", "Accept": "image/*", "Host": parts.netloc.rpartition("@")[2]})
        r = conn.getresponse()
        body = r.read(MAX_IMAGE_BYTES + 1) if r.status == 200 else b""
        if time.monotonic() >= deadline:  # (shut by the timer: what was read may look whole, and is not)
            raise TimeoutError
        if r.status in (301, 302, 303, 307, 308) and r.getheader("Location"):
            return r.status, r.getheader("Location"), b""
        return r.status, None, _at_most_max(len(body), body)
    finally:
        if timer is not None:
            timer.cancel()
        conn.close()


def _shut(sock: socket.socket) -> None:
    """Cut a connection past its deadline: the thread blocked reading it gets an error at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def data_bytes(url: str) -> bytes:
    """A ``data:image/...;base64,`` URL's bytes."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageError(f"an image's data URL must be data:image/...;base64, got {url[:24]!r}")
    _at_most_max((len(url) - m.end()) * 3 // 4)  # (before decoding it)
    try:
        return base64.b64decode(url[m.end():], validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image's data URL is not valid base64") from None


def _at_most_max(size: int, data: bytes = b"") -> bytes:
    """``data`` (of ``size`` bytes), or an ``ImageError`` past ``MAX_IMAGE_BYTES``."""
    if size > MAX_IMAGE_BYTES:
        raise ImageError(f"an image may be at most {MAX_IMAGE_BYTES >> 20} MiB")
    return data


def _host(url: str) -> str:
    try:
        return (urllib.parse.urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""
