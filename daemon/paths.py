"""Where a node keeps its files on this machine: its data dir (identity, secrets) and the
machine-wide cache (speed probes, shards, the registry of ringlet processes).

The lowest layer of ``daemon/``: it imports nothing of ringlet, so every layer can
ask for the data dir without reaching into another's module.
"""

from __future__ import annotations

import os
import sys
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
