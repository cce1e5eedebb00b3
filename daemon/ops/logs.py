"""Logging setup: concise by default, ``-v`` for debug, JSON lines for services.

Text lines (default)::

    14:03:22 I node: stage 0 [0, 10) ready on 127.0.0.1:7100

time, level letter, the logger name without the ``ringlet.daemon.`` prefix, and
the message. JSON lines (``--log-json``; what ``ringlet service install
--json-logs`` configures) carry ``ts`` (UTC, ISO 8601 with milliseconds),
``level``, ``logger``, ``msg``, ``exc`` when there is a traceback, and every
JSON-safe ``extra={...}`` field given to the log call.

Levels: ringlet at INFO (WARNING for one-shot commands), libraries at WARNING;
``-v`` puts ringlet at DEBUG, ``-vv`` every library too.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_PREFIX = "ringlet.daemon."
#: Attributes every LogRecord has; anything else came from ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def short_name(name: str) -> str:
    """``ringlet.daemon.probes.memory`` -> ``probes.memory``."""
    return name[len(_PREFIX):] if name.startswith(_PREFIX) else name


class _TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname).1s %(short)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        record.short = short_name(record.name)
        return super().format(record)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in _STANDARD or key.startswith("_") or key in entry or key == "short":
                continue
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                value = repr(value)
            entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(verbose: int = 0, json_format: bool = False, quiet: bool = False) -> None:
    """Configure the root logger on stderr. ``verbose``: 0 = INFO for ringlet and WARNING
    for libraries, 1 = DEBUG for ringlet, 2+ = DEBUG for libraries too; ``quiet`` =
    WARNING for one-shot commands."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_format else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING)
    logging.getLogger("ringlet").setLevel(
        logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    )
