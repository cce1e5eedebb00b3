"""Where a node keeps its files on this machine: its data dir (identity, secrets) and the
machine-wide cache (speed probes, shards, the registry of ringlet processes).

The lowest layer of ``daemon/``: it imports nothing of ringlet, so every layer can
ask for the data dir without reaching into another's module.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_data_dir() -> Path:
    """Return the default data dir.

    - macOS: ``~/Library/Application Support/ringlet``
    - elsewhere: ``$XDG_DATA_HOME/ringlet``, else ``~/.local/share/ringlet``.

    The daemon's ``--data-dir`` overrides it (pass it to :meth:`NodeIdentity.load_or_create`).
    """
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "ringlet"
    xdg = os.environ.get("XDG_DATA_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "ringlet"
    return home / ".local" / "share" / "ringlet"


def machine_cache_dir() -> Path:
    """Machine-wide cache (``$XDG_CACHE_HOME/ringlet``, ``~/Library/Caches/ringlet`` on macOS)."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = base / "ringlet"
    path.mkdir(parents=True, exist_ok=True)
    return path


def prefix_cache_dir(data_dir: str | Path | None, address: str, static: bool) -> Path:
    """Where the prefix cache's disk tier keeps its files: ``prefix-cache`` in the data
    dir (``data_dir``, else :func:`default_data_dir`). A negotiated node owns its data
    dir (its identity is locked there); static-plan stages may share one, so each gets a
    subdirectory named after its gRPC ``address`` (``host:port``)."""
    base = (Path(data_dir).expanduser() if data_dir else default_data_dir()) / "prefix-cache"
    return base / f"stage-{address.replace(':', '-')}" if static else base


def write_atomically(target: Path, write: Callable[[str], object]) -> Exception | None:
    """Call ``write(tmp_path)`` on a temporary file beside ``target`` and move the result
    to ``target`` in one step, so readers never see half a file. Returns ``None`` once
    written, or the ``OSError``, ``TypeError`` or ``ValueError`` that stopped it (nothing
    is left behind); other errors propagate, after the temporary file is removed."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except (OSError, TypeError, ValueError) as exc:
        return exc
    return None
