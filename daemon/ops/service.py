"""``ringlet service install | uninstall | status``: run ringlet as a login service.

- **macOS**: a launchd agent ``~/Library/LaunchAgents/io.ringlet.ringlet.plist``
  (``RunAtLoad``, ``KeepAlive``), loaded with ``launchctl bootstrap gui/<uid>``;
  logs in ``~/Library/Logs/ringlet/`` (``ringlet.log`` is the daemon's log, stderr).
- **Linux**: a systemd user unit ``~/.config/systemd/user/ringlet.service``
  (``Restart=on-failure``), enabled with ``systemctl --user enable --now``; logs
  in the journal (``journalctl --user -u ringlet``). To start at boot without a
  login: ``sudo loginctl enable-linger $USER``.

Both run ``ringlet run`` with the arguments of the service configuration,
``~/.config/ringlet/service.toml`` (``$XDG_CONFIG_HOME`` respected): cluster name,
secret file, model, interfaces, ports, ... ``install`` merges its options into the
existing configuration, checks that ``ringlet run`` accepts the result, writes
the configuration and the service file, and records what it created in
``service-manifest.json`` next to the configuration, so that ``uninstall``
removes exactly that. ``--dry-run`` prints the files and commands instead.

Exit status of ``service status``: 0 running, 3 installed but not running, 4 not
installed (as ``systemctl status``); 2 bad input everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import plistlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from ringlet.daemon.errors import RingletError

LAUNCHD_LABEL = "io.ringlet.ringlet"
SYSTEMD_UNIT = "ringlet.service"
CONFIG_NAME = "service.toml"
MANIFEST_NAME = "service-manifest.json"
LAUNCHD_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
EXIT_RUNNING, EXIT_BAD_INPUT, EXIT_NOT_RUNNING, EXIT_NOT_INSTALLED = 0, 2, 3, 4
TARGETS = {"macos": "macos", "darwin": "macos", "mac": "macos", "linux": "linux"}


# --------------------------------------------------------------------------- configuration


@dataclass
class ServiceConfig:
    """What the service runs with; each field maps to one ``ringlet run`` option."""

    cluster: str | None = None
    secret_file: str | None = None
    model: str | None = None
    dtype: str | None = None
    interfaces: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)
    host: str | None = None
    advertise_host: str | None = None
    port: int | None = None
    api_host: str | None = None
    api_port: int | None = None
    api_key_file: str | None = None
    data_dir: str | None = None
    memory_limit: str | None = None
    policy: str | None = None
    plan: str | None = None
    log_json: bool = False
    debug: bool = False
    extra_args: list[str] = field(default_factory=list)

    # -- TOML (written by hand: flat keys of strings, ints, bools and string lists)

    def to_toml(self, header: str = "") -> str:
        lines = [f"# {h}" if h else "#" for h in header.splitlines()]
        for f in fields(self):
            value = getattr(self, f.name)
            doc = FIELD_DOCS.get(f.name, "")
            if value is None or value == [] or value is False:
                lines.append(f"# {f.name} = {_toml(EXAMPLES[f.name])}    # {doc}")
            else:
                lines.append(f"{f.name} = {_toml(value)}    # {doc}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str, where: str = "service config") -> ServiceConfig:
        """Raises RingletError naming the file and key on bad content."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RingletError(f"{where}: not valid TOML: {exc}") from None
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in data.items():
            if key not in known:
                raise RingletError(f"{where}: unknown key {key!r} (known: {', '.join(known)})")
            kind = _KINDS[key]
            ok = (isinstance(value, list) and all(isinstance(v, str) for v in value)) if kind is list else (
                isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
            if not ok:
                raise RingletError(f"{where}: {key} must be {_KIND_NAMES[kind]}, not {value!r}")
            kwargs[key] = value
        return cls(**kwargs)


FIELD_DOCS = {
    "cluster": "cluster name: nodes join only a cluster of the same name (ringlet run --cluster)",
    "secret_file": "cluster secret, mode 0600 (ringlet secret new FILE; ringlet run --secret-file)",
    "model": "model directory, .gguf file or short name (ringlet run --model)",
    "dtype": "float16 | bfloat16 | float32 (ringlet run --dtype)",
    "interfaces": "network interfaces for discovery, e.g. Thunderbolt Bridge (ringlet run --interface)",
    "peers": "host:port of peers when multicast is blocked (ringlet run --peers)",
    "host": "gRPC address to bind (ringlet run --host)",
    "advertise_host": "address peers dial, when not --host (ringlet run --advertise-host)",
    "port": "gRPC port (ringlet run --port)",
    "api_host": "HTTP API bind address; 0.0.0.0 serves the network (ringlet run --api-host)",
    "api_port": "HTTP API port (ringlet run --api-port)",
    "api_key_file": "API keys, one per line: /v1/* then needs a Bearer key (ringlet run --api-key-file)",
    "data_dir": "node id and caches (ringlet run --data-dir)",
    "memory_limit": "memory to offer the cluster, e.g. 100GB (ringlet run --memory-limit)",
    "policy": "planner policy: balanced | memory | latency (ringlet run --policy)",
    "plan": "static plan HOST:PORT=START:END,... (ringlet run --plan)",
    "log_json": "log JSON lines (ringlet --log-json)",
    "debug": "debug logging (ringlet -v)",
    "extra_args": "more ringlet run arguments, verbatim",
}
EXAMPLES = {
    "cluster": "home", "secret_file": "~/.config/ringlet/secret", "model": "~/models/Llama-3.3-70B-Instruct-4bit",
    "dtype": "bfloat16", "interfaces": ["bridge0"], "peers": ["10.0.0.2:7100"], "host": "0.0.0.0",  # noqa: S104 - an example in a comment
    "port": 7100, "advertise_host": "10.0.0.1", "api_host": "0.0.0.0", "api_port": 8000,  # noqa: S104
    "api_key_file": "~/.config/ringlet/api-keys", "data_dir": "~/.local/share/ringlet", "memory_limit": "100GB",
    "policy": "balanced", "plan": "",
    "log_json": True, "debug": True, "extra_args": [],
}
_KINDS = {"cluster": str, "secret_file": str, "model": str, "dtype": str, "interfaces": list, "peers": list,
          "host": str, "advertise_host": str, "port": int, "api_host": str, "api_port": int,
          "api_key_file": str, "data_dir": str, "memory_limit": str, "policy": str, "plan": str,
          "log_json": bool, "debug": bool, "extra_args": list}
_KIND_NAMES = {str: "a string", int: "an integer", bool: "true or false", list: "a list of strings"}
#: config field -> ``ringlet run`` option (lists repeat the option, ``peers`` is joined by commas)
RUN_FLAGS = {"cluster": "--cluster", "secret_file": "--secret-file", "model": "--model", "dtype": "--dtype",
             "interfaces": "--interface", "peers": "--peers", "host": "--host",
             "advertise_host": "--advertise-host", "port": "--port", "api_host": "--api-host",
             "api_port": "--api-port", "api_key_file": "--api-key-file", "data_dir": "--data-dir",
             "memory_limit": "--memory-limit", "policy": "--policy", "plan": "--plan"}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (\uXXXX, \", \\, \n ...)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def run_arguments(config: ServiceConfig) -> list[str]:
    """``ringlet`` arguments of the service: global options, ``run``, run options."""
    args: list[str] = []
    if config.log_json:
        args.append("--log-json")
    if config.debug:
        args.append("-v")
    args.append("run")
    for name, flag in RUN_FLAGS.items():
        value = getattr(config, name)
        if value is None or value == []:
            continue
        if name == "interfaces":
            for v in value:
                args += [flag, v]
        elif name == "peers":
            args += [flag, ",".join(value)]
        else:
            args += [flag, str(value)]
    return args + list(config.extra_args)


def ringlet_executable() -> list[str]:
    """The installed ``ringlet`` command (the one next to this Python first), absolute."""
    here = Path(sys.executable).parent / "ringlet"
    if here.is_file() and os.access(here, os.X_OK):
        return [str(here.absolute())]
    found = shutil.which("ringlet")
    if found:
        return [str(Path(found).absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "ringlet.daemon.ops.cli"]


def run_options() -> set[str]:
    """Option strings ``ringlet run`` accepts in this installation."""
    from ringlet.daemon.ops.run_options import run_only_parser

    parser = run_only_parser()
    for action in parser._actions:  # argparse keeps subparsers here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction) and "run" in action.choices:
            return set(action.choices["run"]._option_string_actions)
    return set()


def check_run_arguments(argv: list[str]) -> None:
    """Parse ``argv`` with the real ``ringlet`` parser, so that a service never starts
    with arguments its ``ringlet run`` rejects.

    Raises:
        RingletError: an option unknown to this ``ringlet run``, or a bad value.
    """
    from ringlet.daemon.ops.run_options import run_only_parser

    parser = run_only_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _, unknown = parser.parse_known_args(argv)
    except SystemExit:
        msg = next((ln.split("error:", 1)[1].strip() for ln in err.getvalue().splitlines() if "error:" in ln),
                   err.getvalue().strip())
        raise RingletError(f"ringlet run rejects the service arguments: {msg}") from None
    if unknown:
        options = [u for u in unknown if u.startswith("-")] or unknown
        owners = [k for k, f in RUN_FLAGS.items() if f in options]
        hint = f" (from the config key {', '.join(owners)})" if owners else ""
        raise RingletError(f"this ringlet run does not accept {' '.join(options)}{hint}; "
                           f"remove it from the service configuration or update ringlet")


# --------------------------------------------------------------------------- paths


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


# --------------------------------------------------------------------------- files


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


@dataclass
class Planned:
    """What ``install`` will write and run."""

    target: str
    config: ServiceConfig
    program: list[str]
    files: dict[Path, bytes]
    dirs: list[Path]
    commands: list[list[str]]
    warnings: list[str]


def load_config(path: Path | None = None) -> ServiceConfig | None:
    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RingletError(f"{path}: cannot read: {exc}") from None
    return ServiceConfig.from_toml(text, where=str(path))


def _abs_path(value: str) -> str:
    return str(Path(value).expanduser().absolute())


def merge_options(base: ServiceConfig, args: argparse.Namespace) -> ServiceConfig:
    """``base`` with the options given on the command line applied."""
    cfg = ServiceConfig(**{f.name: getattr(base, f.name) for f in fields(base)})
    for name in ("cluster", "secret_file", "model", "dtype", "host", "advertise_host", "api_host", "api_key_file",
                 "data_dir", "memory_limit", "policy", "plan"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(cfg, name, value or None)
    for name in ("port", "api_port"):
        value = getattr(args, name, None)
        if value is not None:
            try:
                port = int(value)
            except ValueError:
                raise RingletError(f"--{name.replace('_', '-')} {value!r}: not a port number") from None
            if not 1 <= port <= 65535:
                raise RingletError(f"--{name.replace('_', '-')} {port}: give a port in 1..65535")
            setattr(cfg, name, port)
    if getattr(args, "interface", None):
        cfg.interfaces = [i for i in dict.fromkeys(args.interface) if i]  # --interface "" unsets
    if getattr(args, "peers", None) is not None:
        cfg.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if getattr(args, "run_arg", None):
        cfg.extra_args = [a for a in args.run_arg if a]  # --run-arg "" unsets
    if getattr(args, "svc_log_json", False):
        cfg.log_json = True
    if getattr(args, "svc_debug", False):
        cfg.debug = True
    return cfg


def validate(cfg: ServiceConfig, check_model: bool = True) -> list[str]:
    """Make paths absolute and check them; returns warnings.

    Raises:
        RingletError: a missing secret file or model, a bad port.
    """
    warnings: list[str] = []
    if cfg.secret_file:
        cfg.secret_file = _abs_path(cfg.secret_file)
        p = Path(cfg.secret_file)
        if not p.is_file():
            raise RingletError(f"secret file {p} does not exist; create it with: ringlet secret new {p}")
        if p.stat().st_mode & 0o077:
            warnings.append(f"secret file {p} is readable by others; fix: chmod 600 {shlex.quote(str(p))}")
    if cfg.api_key_file:
        cfg.api_key_file = _abs_path(cfg.api_key_file)
        if not Path(cfg.api_key_file).is_file():
            raise RingletError(f"API key file {cfg.api_key_file} does not exist")
    if cfg.data_dir:
        cfg.data_dir = _abs_path(cfg.data_dir)
    if cfg.model:
        from ringlet.daemon.engine.sources import KNOWN_MODELS, resolve

        if cfg.model.lower() not in KNOWN_MODELS:
            cfg.model = _abs_path(cfg.model)
        if check_model:
            resolve(cfg.model)  # raises ModelNotFound with where it looked
    for name in ("port", "api_port"):
        v = getattr(cfg, name)
        if v is not None and not 1 <= v <= 65535:
            raise RingletError(f"{name} = {v}: give a port in 1..65535")
    if cfg.interfaces:
        try:
            import psutil

            present = set(psutil.net_if_stats())
        except Exception:  # psutil may be unable to list interfaces in a sandbox
            present = set()
        missing = [i for i in cfg.interfaces if present and i not in present]
        if missing:
            warnings.append(f"interface {', '.join(missing)} does not exist now (a cable unplugged?); "
                            f"the daemon uses it when it appears")
    if not cfg.secret_file:
        warnings.append("no secret file: the node runs open to anyone on the network "
                        "(ringlet secret new FILE, then --secret-file FILE)")
    return warnings


def plan_install(args: argparse.Namespace, target: str) -> Planned:
    base = ServiceConfig() if args.reset else (load_config() or ServiceConfig())
    cfg = merge_options(base, args)
    warnings = validate(cfg, check_model=target == host_target())
    argv = run_arguments(cfg)
    check_run_arguments(argv)
    program = ringlet_executable() + argv
    cpath = config_path()
    header = (f"ringlet service configuration, written by `ringlet service install` "
              f"({time.strftime('%Y-%m-%d %H:%M')}).\n"
              f"Edit it, then run `ringlet service install` again to apply it.\n"
              f"The service runs: {shlex.join(program)}\n")
    files: dict[Path, bytes] = {cpath: cfg.to_toml(header).encode()}
    dirs = [cpath.parent]
    uid = os.getuid()
    if target == "macos":
        spath = plist_path()
        files[spath] = make_plist(program, cpath)
        dirs += [spath.parent, log_dir()]
        commands = [["launchctl", "bootout", f"gui/{uid}/{LAUNCHD_LABEL}"],
                    ["launchctl", "bootstrap", f"gui/{uid}", str(spath)]]
    else:
        spath = unit_path()
        files[spath] = make_unit(program, cpath).encode()
        dirs += [spath.parent]
        commands = [["systemctl", "--user", "daemon-reload"],
                    ["systemctl", "--user", "enable", "--now", SYSTEMD_UNIT]]
    return Planned(target, cfg, program, files, dirs, commands, warnings)


# --------------------------------------------------------------------------- service managers


def _run(cmd: list[str], timeout: float = 15.0) -> tuple[int, str]:
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
    rc, out = _run(["systemctl", "--user", "show-environment"], timeout=5)
    if rc != 0:
        return False, f"the systemd user manager is not reachable ({out.splitlines()[0] if out else rc})"
    return True, ""


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
            rc, text = _run(cmd)
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
    rc, text = _run(["loginctl", "show-user", user or str(os.getuid()), "--property=Linger"], timeout=5)
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
        rc, text = _run(commands[0])
        first = text.splitlines()[0] if text else rc
        out(f"stopped: {shlex.join(commands[0])}" if rc == 0 else f"(was not running: {first})")
    else:
        out(f"not stopping: {why}")
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
            out(f"removed {f}")
    if ok and target == "linux":
        _run(commands[1])
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
        rc, text = _run(["launchctl", "print", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"])
        if rc != 0:
            out("launchd: not loaded (load it: ringlet service install)")
        else:
            info = _launchctl_fields(text)
            running = info.get("state") == "running"
            out("launchd: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    else:
        rc, text = _run(["systemctl", "--user", "show", SYSTEMD_UNIT,
                         "--property=LoadState,ActiveState,SubState,MainPID,NRestarts,ExecMainStatus"])
        props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        running = props.get("ActiveState") == "active"
        out("systemd: " + ", ".join(f"{k} {v}" for k, v in props.items()))
    api = f"http://{_api_host(cfg)}:{(cfg.api_port if cfg and cfg.api_port else 8000)}"
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


def _api_host(cfg: ServiceConfig | None) -> str:
    host = cfg.api_host if cfg and cfg.api_host else "127.0.0.1"
    wildcard = host in ("0.0.0.0", "::", "")  # noqa: S104 - reading a bind address, not binding
    return "127.0.0.1" if wildcard else (f"[{host}]" if ":" in host else host)


def _launchctl_fields(text: str) -> dict[str, str]:
    """``state``, ``pid``, ``last exit code`` and ``runs`` from ``launchctl print``."""
    wanted = ("state", "pid", "last exit code", "runs")
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(" = ")
        if sep and key in wanted and key not in found:
            found[key] = value.strip()
    return found


# --------------------------------------------------------------------------- CLI


def add_service_parser(subparsers) -> None:
    """Register ``ringlet service`` with its three actions."""
    service = subparsers.add_parser(
        "service", help="install ringlet as a login service (launchd agent / systemd user unit)",
        description="Install, remove or inspect the ringlet service of this user.")
    actions = service.add_subparsers(dest="service_action", metavar="ACTION")
    inst = actions.add_parser("install", help="write the configuration and the service, then start it",
                              description="Options are merged into the existing configuration "
                                          f"({'~/.config/ringlet/' + CONFIG_NAME}); give an empty value to unset one.")
    inst.add_argument("--cluster", help="cluster name")
    inst.add_argument("--secret-file", help="cluster secret file (ringlet secret new FILE)")
    inst.add_argument("--model", help="model directory, .gguf file or short name")
    inst.add_argument("--dtype", help="float16 | bfloat16 | float32")
    inst.add_argument("--interface", action="append", metavar="NAME", help="discovery interface (repeatable)")
    inst.add_argument("--peers", metavar="HOST:PORT,...", help="peers to dial when multicast is blocked")
    inst.add_argument("--host", help="gRPC address to bind")
    inst.add_argument("--advertise-host", help="address peers dial (default: --host)")
    inst.add_argument("--port", help="gRPC port")
    inst.add_argument("--api-host", help="HTTP API bind address (0.0.0.0 for the network)")
    inst.add_argument("--api-port", help="HTTP API port")
    inst.add_argument("--api-key-file", help="API keys file (/v1/* then needs a Bearer key)")
    inst.add_argument("--data-dir", help="data dir (node id, caches)")
    inst.add_argument("--memory-limit", help="memory to offer the cluster, e.g. 100GB")
    inst.add_argument("--policy", help="planner policy: balanced | memory | latency")
    inst.add_argument("--plan", help="static plan HOST:PORT=START:END,...")
    inst.add_argument("--json-logs", dest="svc_log_json", action="store_true", help="the service logs JSON lines")
    inst.add_argument("--debug-logs", dest="svc_debug", action="store_true", help="the service logs debug lines")
    inst.add_argument("--run-arg", action="append", metavar="ARG",
                      help="one more ringlet run argument, verbatim (repeatable; replaces the configured ones)")
    inst.add_argument("--reset", action="store_true", help="start from an empty configuration")
    inst.add_argument("--no-start", action="store_true", help="write the files only; do not load or start")
    inst.add_argument("--dry-run", action="store_true", help="print the files and commands; write nothing")
    inst.add_argument("--target", choices=sorted(set(TARGETS)),
                      help="generate for another OS (with --dry-run)")
    un = actions.add_parser("uninstall", help="stop the service and remove every file install wrote")
    un.add_argument("--keep-config", action="store_true", help="keep the configuration file")
    un.add_argument("--keep-logs", action="store_true", help="keep the log directory (macOS)")
    un.add_argument("--dry-run", action="store_true", help="print what would be removed")
    un.add_argument("--target", choices=sorted(set(TARGETS)), help=argparse.SUPPRESS)
    actions.add_parser("status", help="is it installed, running, answering; where are the logs")


def run_service(args: argparse.Namespace) -> int:
    action = getattr(args, "service_action", None)
    if action == "install":
        return install(args)
    if action == "uninstall":
        return uninstall(args)
    if action == "status":
        return status(args)
    raise RingletError("ringlet service: give an action: install, uninstall or status")
