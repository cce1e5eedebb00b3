"""The lane side of a node serving several models (:mod:`.lanes`): what a child daemon does.

A lane is a plain ``ringlet run`` for one model, with three hidden options its parent sets:
``--lane-share-file`` (the memory the models before it leave: offered as a lower
``--memory-limit``, and followed while it runs by
:class:`~ringlet.daemon.ops.memory_follow.MemoryFollower`), ``--lane-supervisor`` (its
parent's API: it reserves memory there before loading a stage, and it stops when its parent
is gone) and ``--public-api-url`` (the node's API, advertised as its own).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from ringlet.daemon.ops.run_options import parse_size
from ringlet.daemon.probes.memory import size_text

log = logging.getLogger("ringlet.daemon.lanes")

__all__ = ["lane_reserver", "lane_start", "read_share"]

#: Seconds a reserve may take at most (the parent waits up to 30 s for the lanes after it).
RESERVE_TIMEOUT_S = 40.0


def read_share(path: str | os.PathLike[str] | None) -> int | None:
    """The bytes in a lane's share file, or ``None`` (no file, or unreadable)."""
    if not path:
        return None
    try:
        return max(0, int(Path(path).read_text().strip()))
    except (OSError, ValueError):
        return None


def lane_start(args) -> None:
    """Before the daemon sizes itself: its share as ``--memory-limit`` where lower, and a
    watch that stops it (SIGTERM: a clean leave) when its parent is gone."""
    share = read_share(getattr(args, "lane_share_file", None))
    if share is not None:
        flag = parse_size(getattr(args, "memory_limit", None))
        args.memory_limit_given = args.memory_limit  # the follower never offers past it (memory_follow.py)
        if flag is None or share < flag:
            args.memory_limit = str(share)
            log.info("offered %s: what the models before this one leave on this node", size_text(share))
    if getattr(args, "lane_supervisor", None):
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            log.warning("the node's parent process is gone: stopping this model")
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="lane-parent", daemon=True).start()


def lane_reserver(url: str, model: str):
    """``reserve(nbytes)``: ask the parent at ``url`` for ``nbytes`` on this node before a
    load (``POST /v1/lanes/reserve``); returns when the lanes after this one hold no more
    than what is left (the parent's answer). A parent that does not answer: the load goes on,
    logged."""
    async def reserve(nbytes: int) -> None:
        try:
            async with httpx.AsyncClient(timeout=RESERVE_TIMEOUT_S) as client:
                r = await client.post(f"{url.rstrip('/')}/v1/lanes/reserve", json={"model": model, "bytes": nbytes})
                answer = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not reserve %s with the node (%s): loading anyway", size_text(nbytes), exc)
            return
        if not answer.get("ok", True):
            log.warning("the models after this one still hold memory after %.0f s: loading anyway",
                        answer.get("waited_s", 0))

    return reserve
