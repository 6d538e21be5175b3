"""OpenAI-shaped errors: one exception type and the one JSON body every error uses.

Anything that goes wrong with a request becomes ``{"error": {"message", "type",
"param", "code"}}`` with the right HTTP status; handlers raise ``ApiError`` and
the router turns it into a response. ``code`` is a string where OpenAI names the
error (``model_not_found``, ``invalid_api_key``...), else the HTTP status, as vLLM
writes it: one rule for every body, a stream's error event and a WebSocket's (the
Responses API's stream writes it as a string, as OpenAI's types have it there).
"""

from __future__ import annotations

import re

import orjson

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """A request that cannot be served; carries its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | int | None = None,
                 headers: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or []  # e.g. retry-after on a 429

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code_or_status)

    @property
    def code_or_status(self) -> str | int:
        """The ``code`` every OpenAI-shaped error carries: its name, else its HTTP status."""
        return self.code if self.code is not None else self.status

    def renamed(self, names: dict[str, str]) -> ApiError:
        """This refusal with its field named as another API names it (``names``: ours -> theirs), in the
        message too (the Responses, Messages and llama.cpp APIs run as chats and completions do), as are the
        other fields it names there (those spelled with "_": no plain word is one), but where quoted: a
        quoted value is the client's (a tool's name, a schema's key), not a field."""
        if self.param in names:
            self.message = self.message.replace(self.param, names[self.param], 1)
            self.param = names[self.param]
        fields = [re.escape(k) for k in names if "_" in k]
        if fields:
            self.message = re.sub(rf"'[^']*'|\"[^\"]*\"|\b(?:{'|'.join(fields)})\b",
                                  lambda m: names.get(m.group(), m.group()), self.message)
        return self



def shown(value: str) -> str:
    """A client's id as a message quotes it: cut at 256 characters (an id of 60,000 is not said back whole)."""
    return value if len(value) <= 256 else value[:256] + "..."


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def status_error_body(status: int, message: str) -> bytes:
    """The body for errors raised by the HTTP layer itself (404, 405, 413, ...)."""
    return error_body(message, _TYPES.get(status, "invalid_request_error"), None, status)
