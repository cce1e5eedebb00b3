"""``ringlet service``: the launchd plist and systemd unit it generates (parsed, verified),
a real install and uninstall in a temporary $HOME, the configuration file, bad input."""

from __future__ import annotations

import os
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ringlet.daemon.ops.service.config import RUN_FLAGS, ServiceConfig, check_run_arguments, run_options
from ringlet.daemon.ops.service.paths import LAUNCHD_LABEL, host_target, service_file
from ringlet.daemon.ops.service.status import EXIT_NOT_INSTALLED, EXIT_NOT_RUNNING, EXIT_RUNNING
from ringlet.daemon.ops.service.units import systemd_quote

RINGLET = Path(sys.executable).parent / "ringlet"


def svc(home: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env["HOME"] = str(home)
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "service", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def sections(out: str) -> dict[str, str]:
    """``==> name <==`` blocks of a --dry-run."""
    parts = re.split(r"^==> (.+) <==$", out, flags=re.M)
    return {parts[i]: parts[i + 1].strip("\n") for i in range(1, len(parts), 2)}


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    (h / ".profile").write_text("# the user's own file\n")
    return h


@pytest.fixture
def secret(home):
    p = home / "cluster.secret"
    p.write_text("ab" * 32 + "\n")
    p.chmod(0o600)
    return p


CONFIGURED = ["--cluster", "studio", "--model", "smollm2-135m", "--interface", "lo", "--interface", "eth0",
              "--port", "7101", "--api-host", "0.0.0.0", "--api-port", "8001", "--json-logs"]


def test_plist_parses_and_runs_the_installed_ringlet_with_the_configured_arguments(home, secret):
    r = svc(home, "install", "--dry-run", "--target", "macos", *CONFIGURED, "--secret-file", str(secret))
    assert r.returncode == 0, r.stderr
    files = sections(r.stdout)
    plist_file = home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    assert plist_file.name.endswith(".ringlet.plist") and str(plist_file) in files
    plist = plistlib.loads(files[str(plist_file)].encode())
    args = plist["ProgramArguments"]
    assert args[0] == str(RINGLET) and os.access(args[0], os.X_OK)
    assert args[1:] == ["--log-json", "run", "--cluster", "studio", "--secret-file", str(secret), "--model",
                        "smollm2-135m", "--interface", "lo", "--interface", "eth0", "--port", "7101",
                        "--api-host", "0.0.0.0", "--api-port", "8001"]
    # and this ringlet's own parser reads them back as configured
    from ringlet.daemon.ops.cli import _parser

    ns = _parser().parse_args(args[1:])
    assert (ns.command, ns.cluster, ns.port, ns.api_port, ns.interface, ns.log_json) == (
        "run", "studio", 7101, 8001, ["lo", "eth0"], True)
    assert plist["Label"] == LAUNCHD_LABEL and plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    logs = home / "Library" / "Logs" / "ringlet"
    assert plist["StandardErrorPath"] == str(logs / "ringlet.log")
    assert plist["StandardOutPath"] == str(logs / "ringlet.out.log")
    assert "/usr/sbin" in plist["EnvironmentVariables"]["PATH"]  # sysctl, system_profiler, networksetup
    assert "launchctl bootstrap gui/" in files["commands"]
    # the configuration file, as it would be written
    cfg = tomllib.loads(files[str(home / ".config" / "ringlet" / "service.toml")])
    assert cfg == {"cluster": "studio", "secret_file": str(secret), "model": "smollm2-135m",
                   "interfaces": ["lo", "eth0"], "port": 7101, "api_host": "0.0.0.0", "api_port": 8001,
                   "log_json": True}
    assert tree(home) == {".profile": b"# the user's own file\n", "cluster.secret": secret.read_bytes()}


def test_unit_has_execstart_and_restart_and_passes_systemd_analyze(home, tmp_path):
    r = svc(home, "install", "--dry-run", "--target", "linux", *CONFIGURED)
    assert r.returncode == 0, r.stderr
    unit_path = home / ".config" / "systemd" / "user" / "ringlet.service"
    unit = sections(r.stdout)[str(unit_path)]
    lines = unit.splitlines()
    exec_start = [ln for ln in lines if ln.startswith("ExecStart=")]
    assert len(exec_start) == 1
    argv = shlex.split(exec_start[0].removeprefix("ExecStart="))
    assert argv[0] == str(RINGLET) and argv[1:3] == ["--log-json", "run"] and "--cluster" in argv
    assert "Restart=on-failure" in lines and "WantedBy=default.target" in lines
    assert "systemctl --user enable --now ringlet.service" in sections(r.stdout)["commands"]
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here; the unit was checked by parsing only")
    out = tmp_path / "ringlet.service"
    out.write_text(unit + "\n")
    v = subprocess.run(["systemd-analyze", "verify", str(out)], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and "ringlet.service" not in v.stderr, v.stderr


def test_systemd_quoting_survives_spaces_percent_and_dollar(tmp_path):
    weird = tmp_path / "my models" / "50% $HOME \"q\" \\x"
    words = [systemd_quote(str(RINGLET)), "run", systemd_quote("--model"), systemd_quote(str(weird))]
    unit = ("[Unit]\nDescription=t\n[Service]\nType=exec\nExecStart=" + " ".join(words)
            + "\nRestart=on-failure\n[Install]\nWantedBy=default.target\n")
    assert "%%" in words[-1] and "$$" in words[-1]
    # systemd undoes %% and $$ before splitting; shlex follows the same quoting rules for the rest
    assert shlex.split(" ".join(words).replace("%%", "%").replace("$$", "$")) == [
        str(RINGLET), "run", "--model", str(weird)]
    if shutil.which("systemd-analyze"):
        f = tmp_path / "q.service"
        f.write_text(unit)
        v = subprocess.run(["systemd-analyze", "verify", str(f)], capture_output=True, text=True, timeout=60)
        assert v.returncode == 0 and "q.service" not in v.stderr, v.stderr


def test_real_install_then_uninstall_removes_everything_it_wrote(home, secret):
    before = tree(home)
    r = svc(home, "install", "--no-start", "--model", "smollm2-135m", "--secret-file", str(secret),
            "--cluster", "lab")
    assert r.returncode == 0, r.stderr
    target = host_target()
    spath = (home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist" if target == "macos"
             else home / ".config" / "systemd" / "user" / "ringlet.service")
    cpath = home / ".config" / "ringlet" / "service.toml"
    assert spath.is_file() and cpath.is_file()
    assert f"wrote {spath}" in r.stdout and f"wrote {cpath}" in r.stdout and "not started: --no-start" in r.stdout
    assert oct(cpath.stat().st_mode & 0o777) == "0o600"
    cfg = ServiceConfig.from_toml(cpath.read_text())
    assert (cfg.cluster, cfg.model, cfg.secret_file) == ("lab", "smollm2-135m", str(secret))
    if target == "linux":
        assert f"ExecStart={RINGLET} run --cluster lab --secret-file {secret}" in spath.read_text()
    # a second install merges into the configuration
    r = svc(home, "install", "--no-start", "--api-port", "8123")
    assert r.returncode == 0, r.stderr
    cfg = ServiceConfig.from_toml(cpath.read_text())
    assert (cfg.cluster, cfg.api_port) == ("lab", 8123)
    s = svc(home, "status")
    assert s.returncode in (EXIT_NOT_RUNNING, EXIT_RUNNING), s.stdout + s.stderr
    assert str(spath) in s.stdout and "8123" in s.stdout
    r = svc(home, "uninstall")
    assert r.returncode == 0, r.stderr
    assert tree(home) == before
    assert svc(home, "status").returncode == EXIT_NOT_INSTALLED


def test_install_without_a_service_manager_writes_files_and_says_how_to_start(home):
    venv_bin = str(Path(sys.executable).parent)  # no systemctl / launchctl on this PATH
    r = svc(home, "install", "--model", "smollm2-135m", path=venv_bin)
    assert r.returncode == 0, r.stderr
    assert re.search(r"not started: (systemctl|launchctl) not found", r.stdout), r.stdout
    assert ("systemctl --user enable --now ringlet.service" in r.stdout
            or "launchctl bootstrap" in r.stdout)
    r = svc(home, "uninstall", path=venv_bin)
    assert r.returncode == 0 and tree(home) == {".profile": b"# the user's own file\n"}


def test_uninstall_keep_config_and_dry_run(home):
    assert svc(home, "install", "--no-start", "--cluster", "x").returncode == 0
    cpath = home / ".config" / "ringlet" / "service.toml"
    r = svc(home, "uninstall", "--dry-run")
    assert r.returncode == 0 and str(cpath) in sections(r.stdout)["remove"] and cpath.exists()
    r = svc(home, "uninstall", "--keep-config")
    assert r.returncode == 0 and cpath.exists()
    assert not service_file(host_target()).exists()
    r = svc(home, "uninstall")
    assert r.returncode == 0 and "not installed" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["install", "--secret-file", "/nonexistent/secret"], "ringlet secret new"),
    (["install", "--model", "/nonexistent/model"], "not found"),
    (["install", "--port", "99999"], "1..65535"),
    (["install", "--api-port", "http"], "not a port"),
    (["install", "--run-arg=--bogus-flag"], "--bogus-flag"),
    (["install", "--policy", "fastest"], "rejects"),
    (["install", "--target", "macos"] if sys.platform != "darwin" else ["install", "--target", "linux"],
     "--dry-run"),
    ([], "give an action"),
])
def test_bad_input_is_one_error_line(home, args, needle):
    r = svc(home, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error:") and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
    assert tree(home) == {".profile": b"# the user's own file\n"}


def test_bad_config_file_is_named(home):
    cdir = home / ".config" / "ringlet"
    cdir.mkdir(parents=True)
    (cdir / "service.toml").write_text("port = 'seven'\n")
    r = svc(home, "install", "--dry-run")
    assert r.returncode == 2 and "service.toml: port must be an integer" in r.stderr
    (cdir / "service.toml").write_text("colour = 'blue'\n")
    r = svc(home, "install", "--dry-run")
    assert r.returncode == 2 and "unknown key 'colour'" in r.stderr


def test_config_toml_round_trip_with_awkward_strings():
    cfg = ServiceConfig(cluster='home "lab"', model="/Volumes/Models/Llama 3 \\ 70B/ünïcode", interfaces=["en1"],
                        peers=["10.0.0.2:7100", "[fe80::1]:7100"], port=7100, log_json=True,
                        extra_args=["--context", "8192"])
    assert ServiceConfig.from_toml(cfg.to_toml("header\nline two")) == cfg


def test_every_configuration_key_is_a_flag_of_this_ringlet_run():
    missing = sorted(set(RUN_FLAGS.values()) - run_options())
    assert not missing, f"ringlet run does not accept {missing}: update RUN_FLAGS in daemon/ops/service/config.py"
    check_run_arguments(["run", "--model", "smollm2-135m", "--port", "7100"])


def test_empty_option_values_unset_configured_keys():
    import argparse

    from ringlet.daemon.ops.service.install_plan import merge_options

    base = ServiceConfig(cluster="lab", interfaces=["en1"], peers=["h:1"], extra_args=["--context", "8"],
                         model="smollm2-135m")
    ns = argparse.Namespace(cluster="", interface=[""], peers="", run_arg=[""], model=None)
    cfg = merge_options(base, ns)
    assert (cfg.cluster, cfg.interfaces, cfg.peers, cfg.extra_args, cfg.model) == (None, [], [], [],
                                                                                   "smollm2-135m")


def test_a_hub_model_name_is_kept_as_a_name(home, tmp_path, monkeypatch):
    """``--model ORG/NAME@REV`` is written as given (the service resolves it when it runs),
    not made a path of the current directory, and is not looked up at install time."""
    monkeypatch.chdir(tmp_path)
    r = svc(home, "install", "--dry-run", "--model", "mlx-community/Some-Model-4bit@main")
    assert r.returncode == 0, r.stderr
    files = "\n".join(sections(r.stdout).values())
    assert "mlx-community/Some-Model-4bit@main" in files and f"{tmp_path}/mlx-community" not in files, files
