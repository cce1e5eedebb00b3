"""``ringlet service upgrade``: one node of a running cluster to another release.

The steps (``--dry-run`` prints them, README "How to upgrade" is the procedure):

1. **fetch** the new package and its dependencies with the service environment's pip
   (``pip download``), while the node still serves: a release that cannot be fetched
   stops nothing;
2. **drain and stop** the service (``systemctl --user stop`` / ``launchctl bootout``):
   the daemon gets SIGTERM, its API finishes the requests in flight (up to its
   ``--drain-timeout-s``), then it tells its members it is leaving; they re-plan
   without it and carry on the generations it held a stage of;
3. **install** from what was fetched (``pip install --no-index``): the package is
   replaced only while no daemon of it runs, so a running daemon never imports a
   module of the other release;
4. **start** the service again (on a failed install: the previous release, which pip
   leaves in place);
5. **wait** until its ``/healthz`` answers with the new release and a committed plan.

The service environment is the one whose ``ringlet`` the service runs (the interpreter
of that script's ``#!`` line), or ``--python``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.service.config import api_host, load_config, ringlet_executable
from ringlet.daemon.ops.service.manager import manager_available, run_command
from ringlet.daemon.ops.service.paths import (
    LAUNCHD_LABEL,
    SYSTEMD_UNIT,
    host_target,
    log_dir,
    manifest_path,
    service_file,
)

#: ``/healthz`` states of a node that serves a committed plan (``standby``: a hybrid
#: group's member; ``unplanned``: a committed plan without this node or an infeasible one).
SERVING_STATES = ("ready", "serving", "standby", "unplanned")
WAIT_S = 300.0


@dataclass
class Step:
    """One step of the upgrade: a command, and what it does, for people."""

    name: str
    argv: list[str]
    why: str
    timeout: float = 120.0


@dataclass
class UpgradePlan:
    """Everything ``upgrade`` will do, decided before anything is done."""

    target: str
    python: str
    spec: str              #: pip requirement of the new release, ``ringlet==X`` or a wheel file
    version: str | None    #: the release it installs, when known before installing
    api: str               #: this node's API, for /healthz
    fetch_dir: str
    steps: list[Step] = field(default_factory=list)
    api_key_file: str | None = None  #: the service's API keys (/v1/cluster is behind them)


def service_python(program: list[str]) -> str:
    """The interpreter of the environment the service's ``ringlet`` lives in: the ``#!``
    line of the ``ringlet`` script (a venv, pipx), or the program itself when the service
    runs ``python -m ringlet.daemon.ops.cli``."""
    exe = Path(program[0])
    if len(program) > 2 and program[1] == "-m":
        return str(exe)
    try:
        with exe.resolve().open("rb") as fh:
            first = fh.readline(512).decode(errors="replace").strip()
    except OSError as exc:
        raise RingletError(f"cannot read the service's program {exe}: {exc}; give --python") from None
    if first.startswith("#!") and "python" in first:
        return shlex.split(first[2:])[0]
    sibling = exe.resolve().parent / "python"
    if sibling.exists():
        return str(sibling)
    raise RingletError(f"cannot tell which Python runs {exe} (no #! line); give --python")


def installed_release(python: str) -> str | None:
    """The ``ringlet`` release installed in ``python``'s environment (None: none)."""
    code = "from importlib import metadata\ntry: print(metadata.version('ringlet'))\nexcept Exception: pass"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)  # noqa: S603 - the service's own interpreter
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RingletError(f"cannot run the service's Python {python}: {exc}") from None
    return out.stdout.strip() or None


def _wheel_version(path: Path) -> str:
    parts = path.name.split("-")
    if path.suffix != ".whl" or len(parts) < 5 or parts[0] != "ringlet":
        raise RingletError(f"{path} is not a ringlet wheel (ringlet-VERSION-...whl)")
    return parts[1]


def manager_commands(target: str) -> tuple[list[str], list[str]]:
    """The service manager's stop and start commands for this user's ringlet service."""
    if target == "macos":
        domain = f"gui/{os.getuid()}"
        return (["launchctl", "bootout", f"{domain}/{LAUNCHD_LABEL}"],
                ["launchctl", "bootstrap", domain, str(service_file(target))])
    return (["systemctl", "--user", "stop", SYSTEMD_UNIT], ["systemctl", "--user", "start", SYSTEMD_UNIT])


def plan_upgrade(args: argparse.Namespace, dry_run: bool = False) -> UpgradePlan:
    """The steps of ``ringlet service upgrade`` for ``args``; nothing is run.

    Raises:
        RingletError: no service installed, neither or both of ``--to``/``--wheel``, a bad
            wheel path.
    """
    target = host_target()
    if not service_file(target).exists():
        raise RingletError(f"ringlet is not installed as a service here ({service_file(target)} is missing): "
                           "ringlet service install first")
    if bool(args.to) == bool(args.wheel):
        raise RingletError("ringlet service upgrade: give the release, --to VERSION, or a wheel, --wheel PATH")
    try:
        program = json.loads(manifest_path().read_text()).get("program") or ringlet_executable()
    except (OSError, ValueError):
        program = ringlet_executable()
    python = args.python or service_python(program)
    if args.wheel:
        wheel = Path(args.wheel).expanduser().absolute()
        if not wheel.is_file():
            raise RingletError(f"--wheel {wheel}: no such file")
        spec, version = str(wheel), _wheel_version(wheel)
    else:
        spec, version = f"ringlet=={args.to}", args.to
    cfg = load_config()
    api = f"http://{api_host(cfg)}:{(cfg.api_port if cfg and cfg.api_port else 8000)}"
    fetch_dir = args.fetch_dir or (str(Path(tempfile.gettempdir()) / "ringlet-upgrade-XXXXXX") if dry_run
                                   else tempfile.mkdtemp(prefix="ringlet-upgrade-"))
    extra = list(args.pip_arg or [])
    pip = [python, "-m", "pip"]
    stop, start = manager_commands(target)
    plan = UpgradePlan(target, python, spec, version, api, fetch_dir, api_key_file=cfg.api_key_file if cfg else None)
    plan.steps = [
        Step("fetch", [*pip, "download", "--disable-pip-version-check", "--dest", fetch_dir, *extra, spec],
             "the new release and its dependencies, while this node still serves", timeout=900),
        Step("drain and stop", stop,
             "SIGTERM: the API finishes its requests in flight, then the node tells its members it is leaving; "
             "they re-plan without it and carry on the generations it held", timeout=120),
        Step("install", [*pip, "install", "--disable-pip-version-check", "--no-index", "--find-links", fetch_dir,
                         *extra, f"ringlet=={version}"],
             f"into {Path(python).parent.parent} (the service's environment), from what was fetched", timeout=900),
        Step("start", start, "the new release: it joins the cluster, which re-plans with it"),
    ]
    return plan


def _healthz(api: str) -> dict | None:
    try:
        import httpx

        body = httpx.get(f"{api}/healthz", timeout=2, trust_env=False).json()
        return body if isinstance(body, dict) else None
    except Exception:  # not answering (yet): any failure means the same here
        return None


def wait_serving(api: str, version: str | None, timeout: float, out=print) -> dict:
    """Wait until ``api``'s ``/healthz`` answers release ``version`` in a serving state.

    Raises:
        RingletError: not so within ``timeout`` seconds (the last answer is named).
    """
    deadline, last, said = time.monotonic() + timeout, None, None
    while time.monotonic() < deadline:
        h = _healthz(api)
        if h is not None:
            last = h
            if h.get("state") != said:
                said = h.get("state")
                out(f"  {api}: ringlet {h.get('release', '?')}, state {said}")
            if h.get("state") in SERVING_STATES and (version is None or h.get("release") == version):
                return h
        time.sleep(0.5)
    seen = (f"it answers ringlet {last.get('release')}, state {last.get('state')}" if last
            else "it does not answer")
    raise RingletError(f"the service did not come back serving within {timeout:.0f} s ({seen}); {_logs_hint()}")


def cluster_lines(api: str, api_key_file: str | None = None) -> list[str]:
    """What the upgraded node sees of its cluster (``/v1/cluster``): its members' releases,
    and the nodes it keeps out for another wire protocol version; nothing when it cannot
    be read."""
    try:
        import httpx

        from ringlet.daemon.wire.auth import client_api_key

        key = client_api_key(api_key_file)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = httpx.get(f"{api}/v1/cluster", headers=headers, timeout=5, trust_env=False).json()
    except Exception:  # a summary only: the upgrade itself is done
        return []
    members = [m for m in body.get("members") or [] if isinstance(m, dict)]
    releases: dict[str, int] = {}
    for m in members:
        release = str(m.get("release") or "?")
        releases[release] = releases.get(release, 0) + 1
    on = ", ".join(f"{n} on {r}" for r, n in sorted(releases.items()))
    lines = [f"cluster: {len(members)} member{'' if len(members) == 1 else 's'}, {on}"]
    lines += [f"warning: kept out: {x.get('reason') or x.get('node_id')}"
              for x in body.get("incompatible") or [] if isinstance(x, dict)]
    return lines


def _logs_hint() -> str:
    if host_target() == "macos":
        return f"see {log_dir() / 'ringlet.log'}"
    return f"see journalctl --user -u {SYSTEMD_UNIT.removesuffix('.service')}"


def _run(step: Step, out) -> None:
    out(f"{step.name}: {shlex.join(step.argv)}")
    try:
        p = subprocess.run(step.argv, capture_output=True, text=True, timeout=step.timeout, check=False)  # noqa: S603 - fixed argv: pip of the service's environment, the service manager
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RingletError(f"{step.name} failed: {exc}") from None
    if p.returncode != 0:
        text = (p.stderr or p.stdout).strip().splitlines()
        tail = " | ".join(line for line in text[-3:] if line.strip())
        raise RingletError(f"{step.name} failed ({p.returncode}): {tail}")


def upgrade(args: argparse.Namespace, out=print) -> int:
    """Run (or, with ``--dry-run``, print) the upgrade of this node's service."""
    plan = plan_upgrade(args, dry_run=args.dry_run)
    try:
        return _upgrade(plan, args, out)
    finally:
        if not args.fetch_dir and not args.dry_run:
            shutil.rmtree(plan.fetch_dir, ignore_errors=True)


def _upgrade(plan: UpgradePlan, args: argparse.Namespace, out) -> int:
    before = _healthz(plan.api)
    now = (f"node {before.get('node_id', '?')} runs ringlet {before.get('release', '?')}, state "
           f"{before.get('state', '?')}" if before else f"the daemon does not answer on {plan.api}")
    head = f"ringlet service upgrade to ringlet {plan.version}: {now}; environment {plan.python}"
    if args.dry_run:
        out(f"# {head}")
        out("# --dry-run: nothing is fetched, stopped, installed or started. The steps:")
        for i, step in enumerate(plan.steps, 1):
            out(f"{i}. {step.name}: {shlex.join(step.argv)}")
            out(f"   ({step.why})")
        out(f"{len(plan.steps) + 1}. wait until {plan.api}/healthz answers ringlet {plan.version} with a committed "
            f"plan (up to {args.timeout:.0f} s)")
        return 0
    out(head)
    have = installed_release(plan.python)
    if have == plan.version and before and before.get("release") == plan.version:
        out(f"nothing to do: ringlet {have} is installed and running")
        return 0
    ok, why = manager_available(plan.target)
    if not ok:
        raise RingletError(f"cannot stop and start the service: {why}. By hand: stop it, then "
                           f"{plan.python} -m pip install {plan.spec}, then start it")
    started = time.monotonic()
    fetch, stop, install, start = plan.steps
    _run(fetch, out)
    _run(stop, out)
    out(f"  stopped after draining ({time.monotonic() - started:.0f} s so far)")
    try:
        _run(install, out)
    except RingletError as exc:
        rc, text = run_command(start.argv)
        again = "started again on the previous release" if rc == 0 else f"not started again: {text}"
        raise RingletError(f"{exc}; the service was {again} (ringlet {installed_release(plan.python)})") from None
    out(f"  installed ringlet {installed_release(plan.python)} in {Path(plan.python).parent.parent}")
    _run(start, out)
    h = wait_serving(plan.api, plan.version, args.timeout, out)
    for line in cluster_lines(plan.api, plan.api_key_file):
        out(line)
    out(f"done in {time.monotonic() - started:.0f} s: node {h.get('node_id', '?')} runs ringlet "
        f"{h.get('release')} (wire protocol {h.get('protocol_version', '?')}), state {h.get('state')}. "
        "Check `ringlet status` shows it in the cluster before upgrading the next node.")
    return 0


def add_upgrade_parser(actions) -> None:
    """``ringlet service upgrade`` and its options."""
    up = actions.add_parser(
        "upgrade", help="move this node's service to another release: drain, stop, install, start, wait",
        description="Upgrade one node of a running cluster (one node at a time): fetch the release, drain and "
                    "stop the service (its members re-plan without it), install, start, wait until it serves.")
    up.add_argument("--to", metavar="VERSION", help="the release to install from the package index (ringlet==VERSION)")
    up.add_argument("--wheel", metavar="PATH", help="a ringlet wheel to install (python -m build makes one)")
    up.add_argument("--python", metavar="PATH",
                    help="the Python of the service's environment (default: the one its ringlet runs with)")
    up.add_argument("--pip-arg", action="append", metavar="ARG",
                    help="one more pip argument for fetch and install, e.g. --pip-arg=--index-url=URL (repeatable)")
    up.add_argument("--fetch-dir", metavar="DIR", help=argparse.SUPPRESS)
    up.add_argument("--timeout", type=float, default=WAIT_S,
                    help=f"seconds to wait for the restarted node to serve (default {WAIT_S:.0f})")
    up.add_argument("--dry-run", action="store_true", help="print the steps; fetch, stop and install nothing")
