"""The service files ``ringlet service install`` writes: the launchd agent (a plist:
``RunAtLoad``, ``KeepAlive``, logs in ``~/Library/Logs/ringlet/``) and the systemd
user unit (``Restart=on-failure``), each running ``program``."""

from __future__ import annotations

import plistlib
from pathlib import Path

from ringlet.daemon.ops.service.paths import LAUNCHD_LABEL, home, log_dir

LAUNCHD_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


def make_plist(program: list[str], config_file: Path | None = None) -> bytes:
    """The launchd agent for ``program`` (ProgramArguments)."""
    logs = log_dir()
    data = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": program,
        "RunAtLoad": True,
        "KeepAlive": True,
        # an inference server is latency-critical: no background resource limits
        "ProcessType": "Interactive",
        # seconds between SIGTERM and SIGKILL on a stop (launchd's default is 20): the
        # daemon drains for at most --drain-timeout-s (20) first, as under systemd's
        # TimeoutStopSec=30
        "ExitTimeOut": 30,
        "WorkingDirectory": str(home()),
        "EnvironmentVariables": {"PATH": LAUNCHD_PATH, "PYTHONUNBUFFERED": "1"},
        "StandardOutPath": str(logs / "ringlet.out.log"),
        "StandardErrorPath": str(logs / "ringlet.log"),
    }
    if config_file is not None:
        data["Comment"] = f"written by `ringlet service install` from {config_file}"
    return plistlib.dumps(data, sort_keys=False)


def systemd_quote(arg: str) -> str:
    """One ``ExecStart=`` word: ``%`` and ``$`` escaped (specifiers, variables), quoted
    when it holds whitespace, quotes or backslashes (systemd.service "Command lines")."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c.isspace() or c in "\"'\\;" for c in arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def make_unit(program: list[str], config_file: Path | None = None) -> str:
    """The systemd user unit for ``program``."""
    note = f"# Written by `ringlet service install` from {config_file}.\n" if config_file else ""
    return (
        f"{note}"
        "# Edit the configuration, not this file, then run `ringlet service install` again.\n"
        "[Unit]\n"
        "Description=ringlet node (distributed LLM inference)\n"
        "\n"
        "[Service]\n"
        "Type=exec\n"
        f"ExecStart={' '.join(systemd_quote(a) for a in program)}\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "TimeoutStopSec=30\n"
        "Environment=PYTHONUNBUFFERED=1\n"
        "\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )
