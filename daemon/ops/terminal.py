"""Whether the daemon draws in its terminal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable

__all__ = ["drawn", "foreground_terminal", "own_dashboard"]


def foreground_terminal() -> bool:
    """Whether stdout is a terminal this process has in the foreground: a daemon started
    with ``&`` in a shell shares the terminal with the commands typed after it, and a bar or
    dashboard redrawn there erases their output; it logs plainly instead."""
    if not sys.stdout.isatty():
        return False
    try:
        return os.tcgetpgrp(sys.stdout.fileno()) == os.getpgrp()
    except OSError:
        return False


def own_dashboard(args) -> Callable[[asyncio.Event], Awaitable[None]] | None:
    """``draw(stop)``: ``ringlet run``'s live dashboard of its own API (with its own key),
    when stdout is a foreground terminal and ``--no-dashboard`` is not given; else ``None``."""
    if not foreground_terminal() or getattr(args, "no_dashboard", False):
        return None
    from ringlet.daemon.ops.dashboard.live import live_dashboard
    from ringlet.daemon.wire.auth import client_api_key

    local = "127.0.0.1" if args.api_host in ("0.0.0.0", "") else args.api_host  # noqa: S104 - comparison
    key_file = getattr(args, "api_key_file", None)
    key = client_api_key(key_file) if key_file else None  # its own /v1/cluster is behind the same keys
    return lambda stop: live_dashboard(f"http://{local}:{args.api_port}", stop, key)


@contextlib.asynccontextmanager
async def drawn(draw: Callable[[asyncio.Event], Awaitable[None]] | None):
    """Run ``draw(stop)`` (a dashboard, a loading bar) while the block runs; then set
    ``stop`` and give it 2 s to leave its last frame."""
    stop = asyncio.Event()
    task = asyncio.create_task(draw(stop)) if draw is not None else None
    try:
        yield
    finally:
        if task is not None:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=2)
