"""``ringlet service status``: is the service installed, is the configuration applied,
is it loaded / running, does its daemon answer, where are the logs.

Exit status: 0 running, 3 installed but not running, 4 not installed (as
``systemctl status``); 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import plistlib
import shlex

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.service.config import api_host, load_config, ringlet_executable, run_arguments
from ringlet.daemon.ops.service.manager import manager_available, run_command
from ringlet.daemon.ops.service.paths import (
    LAUNCHD_LABEL,
    SYSTEMD_UNIT,
    config_path,
    host_target,
    log_dir,
    service_file,
)
from ringlet.daemon.ops.service.units import systemd_quote

EXIT_RUNNING, EXIT_BAD_INPUT, EXIT_NOT_RUNNING, EXIT_NOT_INSTALLED = 0, 2, 3, 4


def status(args: argparse.Namespace, out=print) -> int:
    target = host_target()
    spath = service_file(target)
    cpath = config_path()
    installed = spath.exists()
    out(f"service file: {spath}" + ("" if installed else " (not installed)"))
    cfg = None
    try:
        cfg = load_config()
    except RingletError as exc:
        out(f"configuration: {exc}")
    if cfg is not None:
        out(f"configuration: {cpath}")
        try:
            program = ringlet_executable() + run_arguments(cfg)
            out(f"runs: {shlex.join(program)}")
            if installed and target == "linux":
                current = f"ExecStart={' '.join(systemd_quote(a) for a in program)}"
                if current not in spath.read_text().splitlines():
                    out("note: the configuration changed since install; apply it: ringlet service install")
            elif installed:
                with contextlib.suppress(OSError, ValueError, plistlib.InvalidFileException):
                    if plistlib.loads(spath.read_bytes()).get("ProgramArguments") != program:
                        out("note: the configuration changed since install; apply it: ringlet service install")
        except RingletError as exc:
            out(f"configuration: {exc}")
    elif installed:
        out(f"configuration: {cpath} (missing)")
    if not installed:
        return EXIT_NOT_INSTALLED
    running = False
    ok, why = manager_available(target)
    if not ok:
        out(f"manager: {why}")
    elif target == "macos":
        rc, text = run_command(["launchctl", "print", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"])
        if rc != 0:
            out("launchd: not loaded (load it: ringlet service install)")
        else:
            info = _launchctl_fields(text)
            running = info.get("state") == "running"
            out("launchd: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    else:
        rc, text = run_command(["systemctl", "--user", "show", SYSTEMD_UNIT,
                         "--property=LoadState,ActiveState,SubState,MainPID,NRestarts,ExecMainStatus"])
        props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        running = props.get("ActiveState") == "active"
        out("systemd: " + ", ".join(f"{k} {v}" for k, v in props.items()))
    api = f"http://{api_host(cfg)}:{(cfg.api_port if cfg and cfg.api_port else 8000)}"
    try:
        import httpx

        h = httpx.get(f"{api}/healthz", timeout=2, trust_env=False).json()
        out(f"daemon: answering on {api} (state {h.get('state', '—')}, node {h.get('node_id', '—')})")
        running = True
    except Exception as exc:  # any failure means "not answering"; say why
        out(f"daemon: not answering on {api} ({type(exc).__name__})")
    if target == "macos":
        out(f"logs: {log_dir() / 'ringlet.log'}")
    else:
        out(f"logs: journalctl --user -u {SYSTEMD_UNIT.removesuffix('.service')}")
    return EXIT_RUNNING if running else EXIT_NOT_RUNNING


def _launchctl_fields(text: str) -> dict[str, str]:
    """``state``, ``pid``, ``last exit code`` and ``runs`` from ``launchctl print``."""
    wanted = ("state", "pid", "last exit code", "runs")
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(" = ")
        if sep and key in wanted and key not in found:
            found[key] = value.strip()
    return found
