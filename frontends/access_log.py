"""The access log and the HTTP metrics: one line per finished request.

``AccessLog`` is the HTTP server's observer: every answered request (however it
ended: a 200 whose stream the client cut, a 4xx from the HTTP layer, a client
that left before its answer, 499) counts in ``http_requests_total`` and, unless
``--disable-log-requests``, gets one line on the ``tokenmill.access`` logger at
INFO: request id (a completion's own id, as in its body and ``x-request-id``),
client, method, endpoint, status, total time, and for generations prompt /
cached / generated tokens, time to first token and finish reason(s) (a call's
choices' distinct reasons, comma-separated; "abort" when the client went away,
"error" when the engine refused). Each WebSocket generation gets a line of its
own (endpoint ``/v1/stream``, status 200, the error's status, or 499 when the
client cancelled it or left). A successful ``/health`` or ``/metrics`` is logged
at DEBUG only: probes and scrapers would drown the rest.

The prompt (the body's ``prompt`` or ``messages``, at most ``MAX_PROMPT_CHARS``)
is logged only with ``--log-prompts``: prompts are user data.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from frontends.generation import Generation
from frontends.http import Request
from frontends.metrics import Metrics

log = logging.getLogger("tokenmill.access")

MAX_PROMPT_CHARS = 2000
_QUIET = frozenset({"/health", "/ping", "/metrics"})


@dataclass
class CallInfo:
    """What an API call leaves on its request (``Request.meta``) for its access line."""

    gen: Generation | None = None
    prompt: object = None  # the body's prompt or messages


class AccessLog:
    def __init__(self, metrics: Metrics | None = None, enabled: bool = True, log_prompts: bool = False,
                 router=None) -> None:
        self.metrics = metrics
        self.enabled = enabled
        self.log_prompts = log_prompts
        self.router = router  # names the handler in the metrics (unknown paths are all "unmatched")

    def __call__(self, req: Request, status: int) -> None:
        """The HTTP server's observer."""
        if self.metrics is not None:  # (the HTTP layer's refusals too: a request without a method or path yet)
            handler = self.router.handler_name(req.path) if self.router is not None else req.path or "unmatched"
            self.metrics.http_response(handler, req.method or "-", status)
        if not self.enabled:
            return
        info = req.meta if isinstance(req.meta, CallInfo) else None
        level = logging.DEBUG if status < 300 and req.path in _QUIET else logging.INFO
        if log.isEnabledFor(level):
            self.line(level, req.id, _peer(req), req.method or "-", req.path[:200] or "-", status, req.started,
                      info.gen if info else None, info.prompt if info else None)

    def websocket(self, request_id: str, client: str, status: int, started: float, gen: Generation | None,
                  prompt: object = None) -> None:
        """One WebSocket generation ended."""
        if self.enabled and log.isEnabledFor(logging.INFO):
            self.line(logging.INFO, request_id, client, "WS", "/v1/stream", status, started, gen, prompt)

    def line(self, level: int, request_id: str, client: str, method: str, endpoint: str, status: int,
             started: float, gen: Generation | None, prompt: object) -> None:
        now = time.monotonic()
        f: dict = {"request_id": request_id, "client": client, "method": method, "endpoint": endpoint,
                   "status": status}
        if gen is not None:
            first = gen.first_token_at
            reasons = dict.fromkeys(c.end_reason or "abort" for c in gen.choices)
            f.update(prompt_tokens=gen.num_prompt_tokens, cached_tokens=gen.num_cached_tokens,
                     generation_tokens=gen.num_completion_tokens,
                     ttft_s=round(first - started, 4) if first is not None else None,
                     finish_reason=",".join(reasons))
        f["total_s"] = round(now - started, 4)
        if self.log_prompts and prompt is not None:
            try:
                text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
            except (RecursionError, ValueError):  # nested past what json writes: the request was refused anyway
                text = "(nested too deeply to log)"
            f["prompt"] = text[:MAX_PROMPT_CHARS]
        log.log(level, "%s", _Text(f), extra={"fields": f})


class _Text:
    """``key=value ...``, formatted only if a text handler writes the record."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict) -> None:
        self.fields = fields

    def __str__(self) -> str:
        parts = []
        for k, v in self.fields.items():
            if v is None:
                v = "-"
            elif isinstance(v, str) and (not v or any(ch in v for ch in ' "=\n\t')):
                v = json.dumps(v, ensure_ascii=False)
            parts.append(f"{k}={v}")
        return " ".join(parts)


def _peer(req: Request) -> str:
    """The client as the log names it: the connection's host:port, or the host a trusted proxy named."""
    return req.forwarded_for or (req.protocol.peer if req.protocol is not None else "-")
