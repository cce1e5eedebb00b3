"""The service configuration, ``~/.config/ringlet/service.toml``, and the ``ringlet run``
arguments it stands for.

:class:`ServiceConfig` has one field per ``ringlet run`` option (cluster name,
secret file, model, interfaces, ports, ...); it reads and writes itself as flat
TOML, with every key documented in the file. :func:`run_arguments` turns it into
the service's command line and :func:`check_run_arguments` checks that this
installation's ``ringlet run`` accepts it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.service.paths import config_path


@dataclass
class ServiceConfig:
    """What the service runs with; each field maps to one ``ringlet run`` option."""

    cluster: str | None = None
    secret_file: str | None = None
    model: str | list[str] | None = None
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
            kinds = _KINDS[key] if isinstance(_KINDS[key], tuple) else (_KINDS[key],)
            if not any(_fits(value, kind) for kind in kinds):
                raise RingletError(f"{where}: {key} must be {' or '.join(_KIND_NAMES[k] for k in kinds)}, "
                                   f"not {value!r}")
            kwargs[key] = value
        return cls(**kwargs)


def _fits(value, kind: type) -> bool:
    if kind is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def config_models(config: ServiceConfig) -> list[str]:
    """The models the service serves, in priority order (``model``: one name or a list)."""
    if config.model is None:
        return []
    return [config.model] if isinstance(config.model, str) else list(config.model)


FIELD_DOCS = {
    "cluster": "cluster name: nodes join only a cluster of the same name (ringlet run --cluster)",
    "secret_file": "cluster secret, mode 0600 (ringlet secret new FILE; ringlet run --secret-file)",
    "model": "model directory, .gguf file, Hub name or short name; a list serves several models, "
             "the first first (ringlet run --model, repeated)",
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
_KINDS: dict[str, type | tuple[type, ...]] = {
          "cluster": str, "secret_file": str, "model": (str, list), "dtype": str, "interfaces": list, "peers": list,
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
        if name in ("interfaces", "model") and isinstance(value, list):
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


def load_config(path: Path | None = None) -> ServiceConfig | None:
    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RingletError(f"{path}: cannot read: {exc}") from None
    return ServiceConfig.from_toml(text, where=str(path))


def api_host(cfg: ServiceConfig | None) -> str:
    """The host a client on this machine dials for the API of ``cfg``: loopback when it
    binds a wildcard (or names no host), an IPv6 address in brackets."""
    host = cfg.api_host if cfg and cfg.api_host else "127.0.0.1"
    wildcard = host in ("0.0.0.0", "::", "")  # noqa: S104 - reading a bind address, not binding
    return "127.0.0.1" if wildcard else (f"[{host}]" if ":" in host else host)
