"""The chat page at ``GET /``: one static HTML file that talks to ``/v1/stream``.

The page is read and filled in (model name, whether a key is needed) once per
frontend process; its script and style are inline, so the response pins a strict
Content-Security-Policy that allows only those, requests back to us, and the data: images a user attaches. With API
keys the page needs no key but says nothing the API would not say without one:
its script asks ``/v1/models`` for the model name with the key the user types.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from frontends.http import Request, Response, Router
from frontends.openai_api import OpenAIApi

_STATIC = Path(__file__).with_name("static")
_HEADERS = [
    ("cache-control", "no-cache"),
    ("x-content-type-options", "nosniff"),
    ("content-security-policy", "default-src 'none'; script-src 'unsafe-inline'; "
     "style-src 'unsafe-inline'; img-src data:; connect-src 'self' ws: wss:; frame-ancestors 'none'"),
]


def register(router: Router, api: OpenAIApi) -> None:
    """Add the page at ``/``."""
    page = (_STATIC / "index.html").read_text(encoding="utf-8")
    model = "" if api.auth_required else escape(api.model)
    body = (page.replace("{{TITLE}}", f"tokenmill · {model}" if model else "tokenmill")
            .replace("{{MODEL}}", model)
            .replace("{{AUTH}}", "required" if api.auth_required else "none")).encode()

    async def chat_page(req: Request) -> Response:
        return Response(200, body, "text/html; charset=utf-8", list(_HEADERS))

    router.add("GET", "/", api.auth.guard(chat_page, key=False))  # (its origin rule: it names the model)
