"""The service managers, ``launchctl`` (launchd, macOS) and ``systemctl --user``
(systemd, Linux): run one of their commands (a fixed argv, no shell) and tell
whether this session can talk to them."""

from __future__ import annotations

import shutil
import subprocess


def run_command(cmd: list[str], timeout: float = 15.0) -> tuple[int, str]:
    """Run a service-manager command; ``(returncode, output)``; 127 when it is missing."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)  # noqa: S603 - fixed launchctl/systemctl argv, no shell
    except FileNotFoundError:
        return 127, f"{cmd[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(cmd)}: timed out after {timeout:.0f} s"
    return p.returncode, (p.stdout + p.stderr).strip()


def manager_available(target: str) -> tuple[bool, str]:
    """Whether this session can talk to launchd (gui domain) / the systemd user manager."""
    if target == "macos":
        if shutil.which("launchctl") is None:
            return False, "launchctl not found"
        return True, ""
    if shutil.which("systemctl") is None:
        return False, "systemctl not found (no systemd)"
    rc, out = run_command(["systemctl", "--user", "show-environment"], timeout=5)
    if rc != 0:
        return False, f"the systemd user manager is not reachable ({out.splitlines()[0] if out else rc})"
    return True, ""
