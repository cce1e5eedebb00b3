"""Logging setup: concise by default, ``-v`` for debug, JSON lines for services."""

from __future__ import annotations

import json
import logging
import sys
import time


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(verbose: int = 0, json_format: bool = False, quiet: bool = False) -> None:
    """Configure the root logger on stderr. ``verbose``: 0 = INFO for ringlet and WARNING
    for libraries, 1+ = DEBUG for ringlet; ``quiet`` = WARNING for one-shot commands."""
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("ringlet").setLevel(
        logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    )
