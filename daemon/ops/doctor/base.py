"""What every ``ringlet doctor`` check shares: its result (:class:`Check`: ``OK``,
``WARN`` or ``FAIL``, a summary and a fix), the :class:`Context` it looks at, and
:func:`run_command` for the system tools it asks."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass
class Check:
    """One check's verdict: ``status`` OK, WARN or FAIL, and a ``fix`` when there is something to do."""

    name: str
    status: str
    summary: str
    fix: str | None = None
    details: dict = field(default_factory=dict)


@dataclass
class Context:
    """What the checks look at (from the options, else the service configuration)."""

    platform: str
    model: str | None = None  # the first of ``models`` (what a single-model check looks at)
    models: list[str] = field(default_factory=list)  # every model the node serves, the first first
    interfaces: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 7100
    api_port: int = 8000
    data_dir: Path | None = None
    secret_file: str | None = None
    config_source: str | None = None
    # filled by the model check, read by later ones
    model_bytes: int | None = None


def run_command(cmd: list[str], timeout: float = 10.0) -> tuple[int, str]:
    """Run a system tool (a fixed argv, no shell): ``(returncode, output)``; 127 when it
    is missing, 124 when it times out or cannot start."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)  # noqa: S603 - fixed argv lists, no shell
    except FileNotFoundError:
        return 127, f"{cmd[0]}: not found"
    except (subprocess.TimeoutExpired, OSError) as exc:
        return 124, str(exc)
    return p.returncode, (p.stdout + p.stderr).strip()
