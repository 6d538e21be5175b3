"""Log set-up for every tokenmill process: ``--log-format text`` or ``json``.

``text`` is the usual one line per record; ``json`` is one JSON object per line
(``time``, ``level``, ``logger``, ``process``, ``message``, and ``exception``
when there is one), what log shippers (Loki, Elasticsearch, Cloud Logging)
parse without a grok pattern. An access-log record (``frontends.access_log``)
carries its fields in ``record.fields``: JSON lines show them as keys of their
own instead of a message. Torch-free and dependency-free: the launcher and the
engine process use it too.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "process": record.processName}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter(log_format: str, text_format: str = TEXT_FORMAT) -> logging.Formatter:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    return JsonFormatter() if log_format == "json" else logging.Formatter(text_format)


def configure(log_format: str = "text", level: str | int = "INFO", text_format: str = TEXT_FORMAT,
              force: bool = False) -> None:
    """Log to stderr in ``log_format``, unless logging is configured already (``force``: replace that)."""
    root = logging.getLogger()
    if root.handlers and not force:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format, text_format))
    logging.basicConfig(level=level, handlers=[handler], force=force)
