"""The live dashboard and ``ringlet dashboard``: poll a :class:`~ringlet.daemon.ops.status.collector.Collector`
at 2 Hz and redraw in place (``rich.live.Live`` with ``auto_refresh=False``; no
clearing, hence no flicker); log lines scroll above the display and warnings and
errors join the event log; ``q`` or Ctrl-C quits. ``--once`` prints one frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Iterator

from rich.console import Console

from ringlet.daemon.ops.dashboard.events import EventTracker
from ringlet.daemon.ops.dashboard.frame import render
from ringlet.daemon.ops.status.collector import Collector
from ringlet.daemon.ops.status.urls import normalize_api_url

log = logging.getLogger(__name__)

#: Poll and redraw period of the live view, seconds (2 Hz).
DEFAULT_INTERVAL_S = 0.5


class _LogToEvents(logging.Handler):
    """Warnings and errors logged in this process, as dashboard events."""

    def __init__(self, tracker: EventTracker):
        super().__init__(logging.WARNING)
        self.tracker = tracker

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.tracker.add("error" if record.levelno >= logging.ERROR else "warning", record.getMessage(),
                             record.created)
        except Exception:  # a log handler must never raise
            self.handleError(record)


@contextlib.contextmanager
def _logs_through(stream) -> Iterator[None]:
    """Point the root logger's stderr/stdout handlers at ``stream`` (the live display's
    proxy, so log lines scroll above the dashboard instead of tearing it)."""
    root = logging.getLogger()
    swapped = []
    for h in root.handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and h.stream in (
                sys.__stderr__, sys.__stdout__):
            swapped.append((h, h.setStream(stream)))
    try:
        yield
    finally:
        for h, old in swapped:
            h.setStream(old)


# --------------------------------------------------------------------------- live loop


@contextlib.contextmanager
def _quit_key(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Iterator[None]:
    """``q`` quits (when stdin is a terminal); Ctrl-C keeps working."""
    try:
        import termios
        import tty

        fd = sys.stdin.fileno()
        if not sys.stdin.isatty():
            raise OSError
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield
        return

    def on_key() -> None:
        try:
            ch = sys.stdin.read(1)
        except (OSError, ValueError):
            return
        if ch in ("q", "Q"):
            stop.set()

    tty.setcbreak(fd)
    loop.add_reader(fd, on_key)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def run_live(collector: Collector, stop: asyncio.Event, *, console: Console | None = None,
                   interval_s: float = DEFAULT_INTERVAL_S, screen: bool = False,
                   tracker: EventTracker | None = None) -> None:
    """Poll ``collector`` every ``interval_s`` and redraw in place until ``stop`` is set."""
    from rich.live import Live

    console = console or Console()
    tracker = tracker or EventTracker()
    loop = asyncio.get_running_loop()
    last_good: dict | None = None
    with Live(console=console, auto_refresh=False, screen=screen, transient=False,
              redirect_stdout=not screen, redirect_stderr=not screen, vertical_overflow="crop") as live:
        with _logs_through(sys.stderr):
            while not stop.is_set():
                started = loop.time()
                snap = tracker.observe(await collector.snapshot())
                height = console.height if screen else max(10, console.height - 1)
                live.update(render(snap, height=height, last_good=last_good, live=True), refresh=True)
                if snap["reachable"]:
                    last_good = snap
                delay = max(0.05, interval_s - (loop.time() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)


async def live_dashboard(api_url: str, stop: asyncio.Event, api_key: str | None = None) -> None:
    """The dashboard of ``ringlet run`` in an interactive terminal, until ``stop`` is set.

    Draws inline (not on the alternate screen), so the last frame stays on the
    terminal; log lines of the daemon scroll above it, and its warnings and errors
    also appear in the event log.
    """
    collector = Collector([api_url], timeout_s=1.0, api_key=api_key)
    tracker = EventTracker()
    handler = _LogToEvents(tracker)
    logging.getLogger().addHandler(handler)
    try:
        await run_live(collector, stop, tracker=tracker, screen=False)
    finally:
        logging.getLogger().removeHandler(handler)
        await collector.aclose()


async def _dashboard_main(api_urls: list[str], interval_s: float, screen: bool, api_key: str | None = None) -> None:
    collector = Collector(api_urls, timeout_s=max(0.5, min(2.0, 2 * interval_s)), api_key=api_key)
    stop = asyncio.Event()
    try:
        with _quit_key(asyncio.get_running_loop(), stop):
            await run_live(collector, stop, interval_s=interval_s, screen=screen)
    finally:
        await collector.aclose()


def run_dashboard(args) -> int:
    """``ringlet dashboard [--api URL ...] [--once] [--interval S]``."""
    from ringlet.daemon.errors import RingletError
    from ringlet.daemon.ops.status.collector import take_snapshot
    from ringlet.daemon.ops.status.urls import default_api_url
    from ringlet.daemon.wire.auth import client_api_key

    urls = [normalize_api_url(u) for u in (args.api or [default_api_url()])]
    api_key = client_api_key(getattr(args, "api_key_file", None))
    if args.once:
        snap = take_snapshot(urls, timeout_s=2.0, api_key=api_key)
        snap = EventTracker().observe(snap)
        console = Console()
        console.print(render(snap))
        return 0 if snap["reachable"] else 1
    try:
        interval = float(args.interval)
    except (TypeError, ValueError):
        raise RingletError(f"--interval {args.interval!r}: not a number of seconds") from None
    if not 0.05 <= interval <= 60:
        raise RingletError(f"--interval {interval}: give between 0.05 and 60 seconds (default 0.5, i.e. 2 Hz)")
    try:
        asyncio.run(_dashboard_main(urls, interval, screen=not args.inline, api_key=api_key))
    except KeyboardInterrupt:
        pass
    return 0
