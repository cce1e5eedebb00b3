"""``ringlet service install`` and ``ringlet service uninstall``.

``install`` writes the planned files (:mod:`ringlet.daemon.ops.service.install_plan`)
atomically, records what it created in ``service-manifest.json`` next to the
configuration, then loads and starts the service (or says how, when there is no
service manager to talk to). ``uninstall`` stops it and removes exactly what the
manifest lists. With ``--dry-run`` both print the files and commands instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.service.install_plan import plan_install
from ringlet.daemon.ops.service.manager import manager_available, run_command
from ringlet.daemon.ops.service.paths import (
    CONFIG_NAME,
    LAUNCHD_LABEL,
    SYSTEMD_UNIT,
    TARGETS,
    home,
    host_target,
    log_dir,
    manifest_path,
    service_file,
)


def _atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_manifest() -> dict:
    try:
        data = json.loads(manifest_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def install(args: argparse.Namespace, out=print) -> int:
    target = TARGETS[args.target] if args.target else host_target()
    if target != host_target() and not args.dry_run:
        raise RingletError(f"--target {target} only works with --dry-run on this {host_target()} machine")
    planned = plan_install(args, target)
    if args.dry_run:
        out(f"# ringlet service install --dry-run ({target}): nothing is written or started.")
        for path, data in planned.files.items():
            out(f"==> {path} <==")
            out(data.decode().rstrip("\n"))
        out("==> commands <==")
        for cmd in planned.commands:
            out(shlex.join(cmd))
        for w in planned.warnings:
            out(f"warning: {w}")
        return 0

    if not home().is_dir():
        raise RingletError(f"the home directory {home()} does not exist (check $HOME)")
    previous = _read_manifest()
    created_files = set(previous.get("files", []))
    created_dirs = list(previous.get("dirs", []))
    for d in planned.dirs:
        missing = []
        p = d
        while not p.exists():
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            m.mkdir(mode=0o755)
            created_dirs.append(str(m))
    for path, data in planned.files.items():
        if not path.exists():
            created_files.add(str(path))
        _atomic_write(path, data, 0o600 if path.name == CONFIG_NAME else 0o644)
        out(f"wrote {path}")
    created_files.add(str(manifest_path()))
    manifest = {"version": 1, "target": target, "installed_at": time.time(), "program": planned.program,
                "files": sorted(created_files), "dirs": list(dict.fromkeys(created_dirs))}
    _atomic_write(manifest_path(), (json.dumps(manifest, indent=2) + "\n").encode())
    out(f"wrote {manifest_path()} (what uninstall removes)")
    out(f"the service runs: {shlex.join(planned.program)}")
    for w in planned.warnings:
        out(f"warning: {w}")

    ok, why = (False, "--no-start given") if args.no_start else manager_available(target)
    if not ok:
        out(f"not started: {why}. Start it later with:")
        for cmd in planned.commands:
            out(f"  {shlex.join(cmd)}")
    else:
        for i, cmd in enumerate(planned.commands):
            rc, text = run_command(cmd)
            if rc != 0 and not (target == "macos" and i == 0):  # bootout of a service not loaded fails: fine
                raise RingletError(f"{shlex.join(cmd)} failed ({rc}): {text}")
        out("started: " + ("launchd agent loaded (RunAtLoad, KeepAlive)" if target == "macos"
                           else f"{SYSTEMD_UNIT} enabled and started (Restart=on-failure)"))
        if target == "linux":
            _linger_advice(out)
    if target == "macos":
        out(f"logs: tail -f {log_dir() / 'ringlet.log'}")
    else:
        out(f"logs: journalctl --user -u {SYSTEMD_UNIT.removesuffix('.service')} -f")
    out("watch it: ringlet dashboard · check it: ringlet service status · ringlet doctor")
    return 0


def _linger_advice(out) -> None:
    user = os.environ.get("USER") or ""
    rc, text = run_command(["loginctl", "show-user", user or str(os.getuid()), "--property=Linger"], timeout=5)
    if rc == 0 and text.strip() == "Linger=no":
        out(f"note: the service starts when you log in; to start it at boot: sudo loginctl enable-linger {user}")


def uninstall(args: argparse.Namespace, out=print) -> int:
    target = TARGETS[args.target] if args.target else host_target()
    if target != host_target() and not args.dry_run:
        raise RingletError(f"--target {target} only works with --dry-run on this {host_target()} machine")
    manifest = _read_manifest()
    spath = service_file(target)
    files = [Path(f) for f in manifest.get("files", [])]
    if spath not in files and spath.exists():
        files.append(spath)  # installed without a manifest: remove the service file only
    if args.keep_config:
        files = [f for f in files if f.name != CONFIG_NAME]
    dirs = [Path(d) for d in manifest.get("dirs", [])]
    if args.keep_logs:
        dirs = [d for d in dirs if d != log_dir()]
    uid = os.getuid()
    commands = ([["launchctl", "bootout", f"gui/{uid}/{LAUNCHD_LABEL}"]] if target == "macos" else
                [["systemctl", "--user", "disable", "--now", SYSTEMD_UNIT],
                 ["systemctl", "--user", "daemon-reload"]])
    if args.dry_run:
        out(f"# ringlet service uninstall --dry-run ({target}): nothing is removed or stopped.")
        out("==> commands <==")
        for cmd in commands:
            out(shlex.join(cmd))
        out("==> remove <==")
        for f in files:
            out(str(f))
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            out(f"{d}/" + (" (with the logs in it)" if d == log_dir() else " (if empty)"))
        return 0
    if not files and not spath.exists():
        out("ringlet is not installed as a service (nothing to remove)")
        return 0
    ok, why = manager_available(target)
    if ok:
        rc, text = run_command(commands[0])
        first = text.splitlines()[0] if text else rc
        out(f"stopped: {shlex.join(commands[0])}" if rc == 0 else f"(was not running: {first})")
    else:
        out(f"not stopping: {why}")
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
            out(f"removed {f}")
    if ok and target == "linux":
        run_command(commands[1])
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        if d == log_dir() and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
            out(f"removed {d}/ (logs)")
            continue
        try:
            d.rmdir()
            out(f"removed {d}/")
        except OSError:
            pass  # not empty (someone else's files) or gone already
    return 0
