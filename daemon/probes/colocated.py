"""How many ringlet processes share this machine's cores, and BLAS threads sized to match.

Several daemons (and tensor ranks) on one machine must not oversubscribe its cores:
each sizes its BLAS threads to ``cores / processes`` (:func:`ringlet.daemon.probes.blas.default_threads`)
and keeps them so as others come and go (:class:`ThreadSizer`), unless given a fixed
count (``--threads``, else ``$RINGLET_THREADS``, which also carries it to the tensor ranks a
daemon starts).
They find each other through a machine-wide directory (``<machine cache>/procs``): each
registers a file named by its pid while it runs; a file whose pid is gone is stale and
removed by the next count. Network namespaces share the file system and the cores, so
daemons in separate namespaces of one machine count each other too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

import psutil

from . import blas

log = logging.getLogger("ringlet.daemon.probes")
DIR_NAME = "procs"


class Registration:
    """This process's entry in ``directory`` (a context manager; :meth:`close` removes it)."""

    def __init__(self, directory: Path, kind: str = "daemon"):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / str(os.getpid())
        self.path.write_text(f"{kind} {_start_time(os.getpid())}\n")

    def close(self) -> None:
        """Remove this process's entry (idempotent)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_time(pid: int) -> str:
    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except (psutil.Error, OSError):
        return "?"


def count(directory: Path) -> int:
    """Live registered processes in ``directory`` (at least 1: the caller). Entries of
    processes that are gone, or whose pid was reused by a newer process, are removed."""
    live = 0
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return 1
    for entry in entries:
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            started = entry.read_text().split()[1]
        except (OSError, IndexError):
            continue
        if psutil.pid_exists(pid) and (started == "?" or started == _start_time(pid)):
            live += 1
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    return max(1, live)


class ThreadSizer:
    """Registers this process in ``directory`` and, every ``period_s`` on a daemon thread,
    sets its BLAS threads to ``fixed`` (default: ``$RINGLET_THREADS`` when set) or to its
    share of the cores.

    ``fixed`` is also exported as ``RINGLET_THREADS`` so that the processes this one starts
    (tensor ranks) keep it. :meth:`stop` unregisters. Never raises once started.
    """

    def __init__(self, directory: Path, fixed: int | None = None, period_s: float = 2.0, kind: str = "daemon"):
        self.directory = Path(directory)
        env = os.environ.get(blas.THREADS_ENV, "")
        self.fixed = fixed if fixed is not None else (int(env) if env.isdigit() and int(env) > 0 else None)
        self.period_s = period_s
        self.kind = kind
        self.threads: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registration: Registration | None = None

    def start(self) -> ThreadSizer:
        """Register and size once now, then keep sizing in the background."""
        self._registration = Registration(self.directory, self.kind)
        if self.fixed is not None:
            os.environ[blas.THREADS_ENV] = str(self.fixed)
        self._size()
        self._thread = threading.Thread(target=self._run, name="blas-threads", daemon=True)
        self._thread.start()
        return self

    def _size(self) -> None:
        n = self.fixed if self.fixed is not None else blas.default_threads(count(self.directory))
        if n != self.threads:
            got = blas.set_threads(n)
            self.threads = n
            if got is not None:
                log.info("BLAS threads: %d%s", got, "" if self.fixed is not None else
                         " (this machine's cores / its ringlet processes)")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._size()
            except Exception as exc:  # sizing threads must never take the process down
                log.warning("cannot size BLAS threads: %s", exc)
                return

    def stop(self) -> None:
        """Stop resizing and unregister (idempotent)."""
        self._stop.set()
        if self._registration is not None:
            self._registration.close()
