"""Who may call the server: API keys and the origin rule, for HTTP and WebSocket alike.

Keys: ``Authorization: Bearer <key>`` (the WebSocket also takes one from its
subprotocol list), compared in constant time against every key. A header carries bytes: a key that is not
ASCII matches as its UTF-8 (curl's, the ``openai`` client's) or its Latin-1 (a browser's ``fetch``).

Origins: a request that carries an ``Origin`` header comes from a browser page.
It is allowed when it is same-origin (the origin's host[:port] equals ``Host``,
and that host is one DNS rebinding cannot take over: an IP address, localhost,
this machine's name, a name under .local or .internal) or listed in
``--allowed-origins`` (``*``: any). (A page of attacker.example whose name the
attacker re-points at 127.0.0.1 sends Origin and Host both attacker.example.) Without API keys any other
origin is refused with 403: a cross-origin WebSocket, or a ``POST`` with a
"simple" content type, reaches the server with no CORS preflight, so CORS alone
would let any web page spend the GPU. A keyless server listening on a loopback address alone also refuses
a request whose ``Host`` is no such name nor an allowed origin's, as Ollama's does: a rebound page's own
``GET``s carry no ``Origin`` (``/props``, ``/metrics``...). With keys the key is the protection and
other origins pass; they just get no CORS headers, so the browser hides the
answer from them. An allowed origin gets ``access-control-allow-origin`` on
every response (errors too) and a 204 to its ``OPTIONS`` preflight.

JSON endpoints also insist on ``Content-Type: application/json`` (415 otherwise):
a browser must preflight that type, so a foreign page cannot send it unseen.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import re
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from frontends.errors import ApiError, shown
from frontends.http import Handler, Request, Response, StreamingResponse

Headers = list[tuple[str, str]]

_PREFLIGHT = [
    ("access-control-allow-headers", "authorization, content-type, x-api-key, anthropic-version"),  # (or as asked)
    ("access-control-max-age", "600"),
]


def normalize_origin(origin: str) -> str:
    """``https://Example.com/`` -> ``https://example.com``: the form browsers send."""
    return origin.strip().rstrip("/").lower()


class Auth:
    """The API keys and allowed origins of one frontend; checks requests against them."""

    def __init__(self, api_keys: Iterable[str] = (), allowed_origins: Iterable[str] = (), loopback: bool = False) -> None:
        keys = list(api_keys)
        if any(not k.strip() for k in keys):  # a blank key would be an open door that looks locked
            raise ValueError("an API key must not be blank")
        for i, k in enumerate(keys):  # (bytes that are no UTF-8, from a shell: no client could send its text)
            try:
                k.encode()
            except UnicodeEncodeError:
                raise ValueError(f"API key {i + 1} is not valid UTF-8") from None
        self._keys = [k.encode() for k in keys]
        # what a client may send for each: its UTF-8, or its Latin-1 where it has one
        self._forms = [{k.encode(), k.encode("latin-1")} if max(k) <= "\xff" else {k.encode()} for k in keys]
        for i, forms in enumerate(self._forms):  # ("sk-é" in UTF-8 is "sk-Ã©" in Latin-1: one would pass as the other)
            for j in range(i):
                if forms & self._forms[j] and keys[i] != keys[j]:
                    raise ValueError(f"API keys {j + 1} and {i + 1} are the same bytes, one in UTF-8 and the other in "
                                     "Latin-1: a client's key could not tell them apart")
        origins = {normalize_origin(o) for o in allowed_origins if o.strip()}
        self._any_origin = "*" in origins
        self._origins = frozenset(origins - {"*"})
        self._hosts = frozenset(_host_key(urlsplit(o).netloc) for o in self._origins)
        self._loopback = loopback  # listening on a loopback address alone (module doc: the Host rule)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    # ------------------------------------------------------------------ keys

    @staticmethod
    def given(req: Request) -> list[str]:
        """The keys a request gives: ``Authorization: Bearer <key>`` (OpenAI's) and ``x-api-key``
        (Anthropic's, whose SDK may send both): either may be the right one. Each is its header's bytes (read
        as Latin-1, as every header is)."""
        scheme, _, token = req.headers.get("authorization", "").partition(" ")
        # (spaces and tabs alone: str.strip would also take bytes 0x85 and 0xA0, the end of a UTF-8 "à" or "Р")
        return [token.strip(" \t") if scheme.lower() == "bearer" else "", req.headers.get("x-api-key", "").strip(" \t")]

    def key_number(self, tokens: list[str]) -> int | None:
        """Which key one of ``tokens`` (bytes as Latin-1 characters) is (its place among the keys, as given),
        None if none is (or no keys)."""
        found = None
        for token in tokens:  # (each against every key, no early exit: the time taken says nothing about which one)
            given = token.encode("latin-1", "replace")
            for i, forms in enumerate(self._forms):
                for form in forms:
                    if hmac.compare_digest(given, form) and found is None:
                        found = i
        return found

    def owner(self, tokens: list[str]) -> str:
        """Whose a stored Response is: a digest of the key of ``tokens`` ("" where none is, or no keys are needed)."""
        i = self.key_number(tokens)
        return "" if i is None else hashlib.sha256(self._keys[i]).hexdigest()

    def check_key(self, tokens: list[str],
                  how: str = "send 'Authorization: Bearer <key>' or 'x-api-key: <key>'") -> None:
        """Raise 401 unless one of ``tokens`` is a key (nothing to check without keys)."""
        if self._keys and self.key_number(tokens) is None:
            raise ApiError(401, f"Invalid or missing API key ({how})", code="invalid_api_key")

    # ------------------------------------------------------------------ origins

    def origin_allowed(self, req: Request) -> bool:
        origin = req.headers.get("origin")
        host = req.headers.get("host", "").lower()
        if origin is None:  # not a browser, or a same-origin request: one of a rebound page's, where it is no name
            return not (self._loopback and host and not self._keys) or self._any_origin \
                or _host_key(host) in self._hosts or _rebinding_proof(host)  # of this machine's (a browser sends one)
        if self._any_origin or normalize_origin(origin) in self._origins:
            return True
        try:
            same = urlsplit(origin).netloc.lower() == host
        except ValueError:  # ("http://[bad": no origin of a page)
            return False
        return same and _rebinding_proof(host)

    def check_origin(self, req: Request) -> Headers:
        """Raise 403 for a foreign origin when no key protects the server; the CORS headers to send."""
        if not self.origin_allowed(req):
            if not self._keys:
                raise _origin_refused(req, keyed=False)
            return []
        origin = req.headers.get("origin")
        return [("access-control-allow-origin", origin), ("vary", "origin")] if origin else []

    async def preflight(self, req: Request, methods: str) -> Response:
        """``OPTIONS``: a CORS preflight, answered for allowed origins only (it never carries a key);
        ``methods``: those the path takes (``Router.add_preflight``)."""
        if not self.origin_allowed(req):  # (with keys too: a page's scripts get CORS only from a listed origin)
            raise _origin_refused(req, keyed=bool(self._keys))
        cors = self.check_origin(req)
        if not cors:
            return Response(204, headers=[("allow", methods)])
        asked = req.headers.get("access-control-request-headers")  # (an allowed page may send what it likes:
        allowed = [(k, asked) if asked and k == "access-control-allow-headers" else (k, v)  # SDKs add their own)
                   for k, v in _PREFLIGHT]
        return Response(204, headers=[("allow", methods), *cors, ("access-control-allow-methods", methods), *allowed])

    # ------------------------------------------------------------------ the HTTP wrapper

    def refuses(self, req: Request, key: bool = True) -> bool:
        """Whether ``guard(..., key=key)`` refuses ``req`` from its head alone (a foreign origin on a server
        without keys, or a missing or wrong key): ``Router.add``'s ``refuses``, so its body is never read."""
        if not self._keys:
            return not self.origin_allowed(req)
        return key and self.key_number(self.given(req)) is None

    def guard(self, handler: Handler, *, key: bool = True, json_body: bool = False) -> Handler:
        """``handler`` behind the origin rule, the key (``key``) and a JSON content type (``json_body``)."""

        async def guarded(req: Request) -> Response | StreamingResponse:
            cors = self.check_origin(req)
            try:
                if key:
                    self.check_key(self.given(req))
                if json_body:
                    require_json(req)
                resp = await handler(req)
            except ApiError as e:
                if cors:  # so the page can read why (in the route's own shape: frontends.http.shaped_errors)
                    e.headers = [*e.headers, *cors]
                raise
            if cors:
                resp.headers = [*resp.headers, *cors]
            return resp

        return guarded


_MEDIA_PARAM = re.compile(r'\s*([^=;\s]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')  # a media type's name=value parameter


def require_json(req: Request) -> None:
    """Raise 415 unless the body is declared JSON (``application/json`` or ``application/*+json``), in UTF-8 (a
    ``charset`` parameter, if any, says so: JSON is UTF-8, RFC 8259) and not compressed (a ``Content-Encoding``,
    if any, is ``identity``: RFC 7694's 415). Such a body was read as plain UTF-8 JSON, whatever it said."""
    mime, _, params = req.headers.get("content-type", "").partition(";")
    mime = mime.strip().lower()
    if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
        raise ApiError(415, f"Content-Type must be application/json, not {mime or 'missing'}",
                       code="unsupported_media_type")
    # (a parameter's value may be quoted, a ";" inside it: RFC 9110's quoted-string)
    for name, value in _MEDIA_PARAM.findall(params):
        quoted = len(value) > 1 and value[0] == value[-1] == '"'
        charset = (value[1:-1] if quoted else value.strip().strip('"')).lower()
        if name.lower() == "charset" and charset not in ("utf-8", "utf8", "us-ascii", "ascii"):  # (a subset)
            raise ApiError(415, f"JSON bodies are UTF-8 here, not {charset or 'an empty charset'}",
                           code="unsupported_media_type")
    coding = req.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("identity", ""):
        raise ApiError(415, f"Content-Encoding {coding} is not accepted: send the body uncompressed",
                       code="unsupported_media_type")


def loopback_only(host: str) -> bool:
    """Whether a server bound to ``host`` listens on a loopback address alone."""
    name = host.strip("[]").rstrip(".").lower()
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return name == "localhost"
    return addr.is_loopback or getattr(addr, "ipv4_mapped", None) is not None and addr.ipv4_mapped.is_loopback


def _host_key(host: str) -> str:
    """A ``Host`` (or an origin's host[:port]) as compared: lower case, no trailing dot, no default port."""
    name, sep, port = host.lower().rpartition(":")
    if not (sep and port.isdigit()):  # (no port: "[::1]" ends in "1]")
        name, port = host.lower(), ""
    name = name.rstrip(".")
    return name if port in ("", "80", "443") else f"{name}:{port}"


def _rebinding_proof(host: str) -> bool:
    """Whether a ``Host`` header names this server in a way no other site's DNS can: an IP address,
    localhost (or a name under it), this machine's own name, or a name under .local or .internal
    (as Ollama's check). Any other name may be an attacker's, pointed at this server (DNS rebinding)."""
    if any(c in host for c in "@/?#\\"):  # (no Host a browser sends: "attacker.example@127.0.0.1" is no IP)
        return False
    try:
        name = (urlsplit("//" + host).hostname or "").rstrip(".")
    except ValueError:  # (a malformed port or bracket)
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    try:  # (IPv4 as inet_aton reads it: 127.1, 2130706433; no DNS name)
        socket.inet_aton(name)
        return True
    except OSError:
        pass
    return name in ("localhost", _machine_name()) or name.endswith((".localhost", ".local", ".internal"))


@functools.cache
def _machine_name() -> str:
    return socket.gethostname().lower()


def _origin_refused(req: Request, keyed: bool) -> ApiError:
    fix = "" if keyed else ", or configure API keys"  # (a keyed server's preflight: listing is the one fix)
    if req.headers.get("origin") is None:
        return ApiError(403, f"Host {shown(req.headers.get('host', ''))} is no name of this machine, which a "
                        "server on a loopback address answers alone without API keys (DNS rebinding: list its "
                        f"origin in --allowed-origins{fix})", type="permission_error", code="host_not_allowed")
    return ApiError(403, f"Cross-origin request from {req.headers.get('origin')} refused (list it in "
                    f"--allowed-origins{fix})", type="permission_error", code="origin_not_allowed")
