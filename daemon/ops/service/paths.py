"""Where ``ringlet service`` keeps its files, and which service manager this host has.

- the configuration ``service.toml`` and ``service-manifest.json`` (what ``install``
  created) in ``~/.config/ringlet/`` (``$XDG_CONFIG_HOME`` respected);
- **macOS**: the launchd agent ``~/Library/LaunchAgents/io.ringlet.ringlet.plist``,
  its logs in ``~/Library/Logs/ringlet/``;
- **Linux**: the systemd user unit ``~/.config/systemd/user/ringlet.service``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LAUNCHD_LABEL = "io.ringlet.ringlet"
SYSTEMD_UNIT = "ringlet.service"
CONFIG_NAME = "service.toml"
MANIFEST_NAME = "service-manifest.json"
TARGETS = {"macos": "macos", "darwin": "macos", "mac": "macos", "linux": "linux"}


def home() -> Path:
    return Path.home()


def config_dir() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home() / ".config"
    return base / "ringlet"


def config_path() -> Path:
    return config_dir() / CONFIG_NAME


def manifest_path() -> Path:
    return config_dir() / MANIFEST_NAME


def plist_path() -> Path:
    return home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"


def log_dir() -> Path:
    return home() / "Library" / "Logs" / "ringlet"


def unit_path() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home() / ".config"
    return base / "systemd" / "user" / SYSTEMD_UNIT


def host_target() -> str:
    return "macos" if sys.platform == "darwin" else "linux"


def service_file(target: str) -> Path:
    return plist_path() if target == "macos" else unit_path()
