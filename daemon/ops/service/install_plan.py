"""What ``ringlet service install`` will write and run (:class:`Planned`), written nowhere yet.

The options given are merged into the existing configuration
(:func:`merge_options`), its paths made absolute and checked (:func:`validate`),
``ringlet run`` is asked whether it accepts the result, and the configuration file,
the service file (plist or unit) and the service-manager commands follow
(:func:`plan_install`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from dataclasses import dataclass, fields
from pathlib import Path

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.service.config import (
    ServiceConfig,
    check_run_arguments,
    config_models,
    load_config,
    ringlet_executable,
    run_arguments,
)
from ringlet.daemon.ops.service.paths import (
    LAUNCHD_LABEL,
    SYSTEMD_UNIT,
    config_path,
    host_target,
    log_dir,
    plist_path,
    unit_path,
)
from ringlet.daemon.ops.service.units import make_plist, make_unit


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


def _abs_path(value: str) -> str:
    return str(Path(value).expanduser().absolute())


def merge_options(base: ServiceConfig, args: argparse.Namespace) -> ServiceConfig:
    """``base`` with the options given on the command line applied."""
    cfg = ServiceConfig(**{f.name: getattr(base, f.name) for f in fields(base)})
    for name in ("cluster", "secret_file", "dtype", "host", "advertise_host", "api_host", "api_key_file",
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
    given = getattr(args, "model", None)
    if given is not None:  # every --model given replaces the configured list; --model "" unsets
        models = [m for m in ([given] if isinstance(given, str) else given) if m]
        cfg.model = None if not models else models[0] if len(models) == 1 else models
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
    models = [_model_ref(m, check_model) for m in config_models(cfg)]
    twice = sorted({m for m in models if models.count(m) > 1})
    if twice:
        raise RingletError(f"model {twice[0]} is given twice; give each model once, the first first")
    if models:
        cfg.model = models[0] if len(models) == 1 else models
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


def _model_ref(model: str, check_model: bool) -> str:
    """``model`` as the service keeps it: a Hub name or a short name as given, a path made
    absolute; checked to exist here when ``check_model`` (raises ModelNotFound naming where
    it looked)."""
    from ringlet.daemon.engine.hub import parse_ref
    from ringlet.daemon.engine.sources import KNOWN_MODELS, resolve

    if parse_ref(model) is not None:  # a Hub name: the service resolves it (and downloads) when it runs
        return model
    if model.lower() not in KNOWN_MODELS:
        model = _abs_path(model)
    if check_model:
        resolve(model)
    return model


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
