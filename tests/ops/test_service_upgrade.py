"""``ringlet service upgrade``: the steps it prints (--dry-run), a fetch that fails stops
nothing, and a real upgrade of a real daemon from one wheel to the next.

There is no systemd user manager here, so ``systemctl`` is a stand-in script on PATH that
does what systemd would with the unit ``ringlet service install`` wrote: ``start`` runs
its ``ExecStart`` (a real ``ringlet run``), ``stop`` sends that process SIGTERM and waits
for it to exit; every call is logged. The service's environment is a throwaway venv (the
suite's own .venv is never touched): this tree, zipped as a wheel of release ``0.2.0.dev1``,
is installed in it and upgraded to the same code as ``0.2.0.dev2``, so the restarted
daemon's ``/healthz`` proves it runs the newly installed package.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import httpx
import pytest

from ringlet.daemon.wire.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]

FAKE_SYSTEMCTL = r"""#!/usr/bin/env bash
# stand-in for `systemctl --user ...` (no systemd here): runs the unit's ExecStart for real
echo "$*" >> "$HOME/systemctl.log"
unit="$HOME/.config/systemd/user/ringlet.service"
pidf="$HOME/ringlet.pid"
start() { cmd=$(sed -n 's/^ExecStart=//p' "$unit")
          nohup $cmd >>"$HOME/daemon.log" 2>&1 </dev/null & echo $! > "$pidf"; }
case "$2" in
  start) start ;;
  enable) [ "$3" = --now ] && start ;;
  stop) if [ -f "$pidf" ]; then pid=$(cat "$pidf"); kill -TERM "$pid" 2>/dev/null
          for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
          kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"; rm -f "$pidf"; fi ;;
esac
exit 0
"""


def free_port() -> int:
    """A port outside the ephemeral range, held from other test workers (the daemon binds it
    seconds later: a port the kernel picks could meanwhile be taken by a client connection)."""
    return free_ports(1)[0]


def fake_manager(tmp_path: Path) -> str:
    """A PATH whose ``systemctl`` is the stand-in."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    script = bin_dir / "systemctl"
    script.write_text(FAKE_SYSTEMCTL)
    script.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def run(home: Path, argv: list[str], path: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), PATH=path)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=home)


def tree_wheel(version: str, out_dir: Path) -> Path:
    """A wheel of this tree's ``daemon/`` and ``partitioning/`` (code and package data: the
    console's page and libraries) as release ``version``, zipped
    here (``make wheel-check`` tests what ``python -m build`` makes; this test needs two
    releases of the same code, fast)."""
    files = {f"ringlet/{p.relative_to(ROOT).as_posix()}": p.read_bytes()
             for top in ("daemon", "partitioning") for p in sorted((ROOT / top).rglob("*"))
             if p.is_file() and not {"__pycache__", "node_modules"} & set(p.parts) and p.suffix != ".pyc"}
    info = f"ringlet-{version}.dist-info/"
    files[info + "METADATA"] = f"Metadata-Version: 2.1\nName: ringlet\nVersion: {version}\n".encode()
    files[info + "WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: test_service_upgrade\nRoot-Is-Purelib: true\n"
                             b"Tag: py3-none-any\n")
    files[info + "entry_points.txt"] = b"[console_scripts]\nringlet = ringlet.daemon.ops.cli:entry\n"
    lines = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
             f"{len(data)}" for name, data in files.items()]
    files[info + "RECORD"] = ("\n".join([*lines, f"{info}RECORD,,"]) + "\n").encode()
    target = out_dir / f"ringlet-{version}-py3-none-any.whl"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for name, data in files.items():
            dst.writestr(name, data)
    return target


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    return h


def test_dry_run_prints_fetch_drain_install_start_wait_and_does_nothing(home, tmp_path):
    path = fake_manager(tmp_path)
    r = run(home, [sys.executable, "-m", "ringlet.daemon.ops.cli", "service", "install", "--no-start",
                   "--model", "smollm2-135m", "--api-port", "8123"], path)
    assert r.returncode == 0, r.stderr
    r = run(home, [sys.executable, "-m", "ringlet.daemon.ops.cli", "service", "upgrade", "--to", "0.3.0",
                   "--dry-run"], path)
    assert r.returncode == 0, r.stderr
    steps = [ln for ln in r.stdout.splitlines() if ln[:2] in ("1.", "2.", "3.", "4.", "5.")]
    python = str(Path(sys.executable).parent / "python")
    assert [s.split(":")[0] for s in steps] == ["1. fetch", "2. drain and stop", "3. install", "4. start",
                                                "5. wait until http"]
    assert "-m pip download" in steps[0] and steps[0].endswith("ringlet==0.3.0")
    assert steps[1].endswith("systemctl --user stop ringlet.service")
    assert "pip install" in steps[2] and "--no-index --find-links" in steps[2] and steps[2].endswith("ringlet==0.3.0")
    assert steps[3].endswith("systemctl --user start ringlet.service")
    assert "http://127.0.0.1:8123/healthz answers ringlet 0.3.0" in steps[4]
    assert Path(steps[0].split()[2]).parent == Path(python).parent  # the service's environment
    assert "tells its members it is leaving" in r.stdout
    assert not (home / "systemctl.log").exists()  # not even asked whether systemd is there


@pytest.mark.parametrize("args, needle", [
    ([], "--to VERSION"),
    (["--to", "1.0", "--wheel", "x.whl"], "--to VERSION"),
    (["--wheel", "/nonexistent/ringlet-1.0-py3-none-any.whl"], "no such file"),
])
def test_bad_input_is_one_error_line(home, tmp_path, args, needle):
    path = fake_manager(tmp_path)
    assert run(home, [sys.executable, "-m", "ringlet.daemon.ops.cli", "service", "install", "--no-start"],
               path).returncode == 0
    r = run(home, [sys.executable, "-m", "ringlet.daemon.ops.cli", "service", "upgrade", *args], path)
    assert r.returncode == 2 and r.stderr.startswith("error:") and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_not_installed_says_install_first(home, tmp_path):
    r = run(home, [sys.executable, "-m", "ringlet.daemon.ops.cli", "service", "upgrade", "--to", "1.0"],
            fake_manager(tmp_path))
    assert r.returncode == 2 and "ringlet service install first" in r.stderr


def test_a_release_that_cannot_be_fetched_stops_nothing(home, tmp_path):
    path = fake_manager(tmp_path)
    assert run(home, [sys.executable, "-m", "ringlet.daemon.ops.cli", "service", "install", "--no-start"],
               path).returncode == 0
    empty = tmp_path / "no-index"
    empty.mkdir()
    r = run(home, [sys.executable, "-m", "ringlet.daemon.ops.cli", "service", "upgrade", "--to", "99.0.0",
                   "--pip-arg=--no-index", f"--pip-arg=--find-links={empty}"], path)
    assert r.returncode == 2 and "fetch failed" in r.stderr and "ringlet==99.0.0" in r.stderr, r.stderr
    calls = (home / "systemctl.log").read_text().splitlines()
    assert calls == ["--user show-environment"], calls  # never stopped


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """This tree as release 0.2.0.dev1 and as 0.2.0.dev2."""
    out = tmp_path_factory.mktemp("wheels")
    return tree_wheel("0.2.0.dev1", out), tree_wheel("0.2.0.dev2", out)


def service_env(tmp_path: Path, wheel: Path) -> Path:
    """A throwaway venv with ``wheel`` installed; its dependencies are the suite's (a .pth
    names .venv's site-packages, after the venv's own)."""
    env = tmp_path / "svcenv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    (site,) = (env / "lib").glob("python3*/site-packages")
    deps = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)]
    (site / "suite-deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", str(wheel)], check=True, timeout=300, capture_output=True)
    return env


def healthz(api: str) -> dict | None:
    try:
        return httpx.get(f"{api}/healthz", timeout=2, trust_env=False).json()
    except httpx.HTTPError:
        return None


def test_upgrade_drains_installs_restarts_and_serves_the_new_release(home, tmp_path, wheels):
    old_wheel, new_wheel = wheels
    old, new = old_wheel.name.split("-")[1], new_wheel.name.split("-")[1]
    env = service_env(tmp_path, old_wheel)
    path = fake_manager(tmp_path)
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    ringlet = str(env / "bin" / "ringlet")
    r = run(home, [ringlet, "service", "install", "--model", "smollm2-135m", "--cluster",
                   f"upgrade-{uuid.uuid4().hex[:8]}", "--interface", "lo", "--host", "127.0.0.1",
                   "--port", str(free_port()), "--api-port", str(api_port), "--data-dir", str(home / "data")],
            path)
    assert r.returncode == 0, r.stderr
    assert f"ExecStart={ringlet} run" in (home / ".config/systemd/user/ringlet.service").read_text()
    assert "started:" in r.stdout, r.stdout
    try:
        deadline = time.monotonic() + 240
        while (h := healthz(api)) is None or h.get("state") not in ("ready", "serving"):
            assert time.monotonic() < deadline, (home / "daemon.log").read_bytes()[-3000:]
            time.sleep(0.5)
        assert h["release"] == old
        first_pid = (home / "ringlet.pid").read_text().strip()
        r = run(home, [ringlet, "service", "upgrade", "--wheel", str(new_wheel), "--pip-arg=--no-deps",
                       "--timeout", "240"], path)
        print(r.stdout)
        assert r.returncode == 0, r.stdout + r.stderr + (home / "daemon.log").read_text()[-3000:]
        # the service's environment was found from its ringlet's #! line, and upgraded
        assert f"environment {env}/bin/python" in r.stdout
        calls = (home / "systemctl.log").read_text().splitlines()
        assert calls[-3:] == ["--user show-environment", "--user stop ringlet.service",
                              "--user start ringlet.service"], calls
        order = [ln.split(":")[0] for ln in r.stdout.splitlines() if ln.split(":")[0] in
                 ("fetch", "drain and stop", "install", "start")]
        assert order == ["fetch", "drain and stop", "install", "start"]
        assert f"runs ringlet {new} (wire protocol" in r.stdout
        assert f"cluster: 1 member, 1 on {new}" in r.stdout
        h = healthz(api)
        assert h["release"] == new and h["state"] in ("ready", "serving")
        assert (home / "ringlet.pid").read_text().strip() != first_pid
        log = (home / "daemon.log").read_text()
        assert "draining the API requests in flight" in log and "stopped after" in log
        # it answers as before
        reply = httpx.post(f"{api}/v1/completions", json={"model": "smollm2-135m", "prompt": "The capital of France is",
                                                          "max_tokens": 4, "temperature": 0}, timeout=120,
                           trust_env=False)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    finally:
        run(home, ["systemctl", "--user", "stop", "ringlet.service"], path, timeout=120)
