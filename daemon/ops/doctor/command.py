"""The ``ringlet doctor`` command: the checks in order (:data:`CHECKS`, :func:`run_checks`),
its options (defaulting to the service configuration), and the report, as text
wrapped to the terminal or as JSON. Exit status: 1 when any check FAILs, else 0
(2 for bad input)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ringlet.daemon.ops.doctor.base import FAIL, OK, WARN, Check, Context
from ringlet.daemon.ops.doctor.compute import check_blas, check_dtype
from ringlet.daemon.ops.doctor.config import check_secret, check_service
from ringlet.daemon.ops.doctor.machine import check_disk, check_memory, check_mlx, check_model, check_wired_limit
from ringlet.daemon.ops.doctor.network import (
    check_daemon,
    check_firewall,
    check_multicast,
    check_ports,
    check_thunderbolt,
)
from ringlet.daemon.ops.doctor.versions import check_versions
from ringlet.daemon.wire import versions

CHECKS: list[tuple[str, Callable[[Context], Check]]] = [
    ("mlx device", check_mlx), ("blas", check_blas), ("model", check_model), ("dtype", check_dtype),
    ("memory", check_memory),
    ("gpu wired limit", check_wired_limit), ("disk space", check_disk), ("multicast", check_multicast),
    ("ports", check_ports), ("firewall", check_firewall), ("thunderbolt", check_thunderbolt),
    ("secret", check_secret), ("service", check_service), ("daemon", check_daemon), ("versions", check_versions),
]


def run_checks(ctx: Context) -> list[Check]:
    """Every check, in order; a check that raises becomes a WARN ("could not check")."""
    results = []
    for name, fn in CHECKS:
        try:
            results.append(fn(ctx))
        except Exception as exc:  # a broken probe must not hide the other checks
            results.append(Check(name, WARN, f"could not check: {type(exc).__name__}: {exc}",
                                 "please report this with the output of ringlet -v doctor"))
    return results


# --------------------------------------------------------------------------- CLI


def add_doctor_parser(subparsers) -> None:
    d = subparsers.add_parser("doctor", help="check this machine for running a node, with fixes",
                              description="Checks MLX, the model, memory, disk, network, firewall, Thunderbolt, "
                                          "secret and service. Options default to the service configuration. "
                                          "Exit status 1 when a check FAILs.")
    d.add_argument("--model", action="append", metavar="MODEL",
                   help="model to check, repeatable (default: the service's models, else the default model)")
    d.add_argument("--interface", action="append", metavar="NAME", help="discovery interface (repeatable)")
    d.add_argument("--host", help="gRPC bind address (default 127.0.0.1)")
    d.add_argument("--port", help="gRPC port (default 7100)")
    d.add_argument("--api-port", help="API port (default 8000)")
    d.add_argument("--data-dir", help="data dir (default: the platform's)")
    d.add_argument("--secret-file", help="cluster secret file")
    d.add_argument("--json", action="store_true", help="print the results as JSON")


def _port_arg(value, default: int, what: str) -> int:
    from ringlet.daemon.errors import RingletError

    if value is None:
        return default
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise RingletError(f"{what} {value!r}: not a port number") from None
    if not 1 <= port <= 65535:
        raise RingletError(f"{what} {port}: give a port in 1..65535")
    return port


def make_context(args: argparse.Namespace) -> Context:
    from ringlet.daemon.errors import RingletError
    from ringlet.daemon.ops.service.config import ServiceConfig, config_models, load_config
    from ringlet.daemon.ops.service.paths import config_path

    try:
        cfg = load_config()
    except RingletError:
        cfg = None
    cfg = cfg or ServiceConfig()
    source = str(config_path()) if config_path().exists() else None
    data_dir = args.data_dir or cfg.data_dir
    models = [m for m in (args.model or []) if m] or config_models(cfg)
    return Context(
        platform=sys.platform,
        model=models[0] if models else None,
        models=models,
        interfaces=list(args.interface or cfg.interfaces or []),
        host=args.host or cfg.host or "127.0.0.1",
        port=_port_arg(args.port if args.port is not None else cfg.port, 7100, "--port"),
        api_port=_port_arg(args.api_port if args.api_port is not None else cfg.api_port, 8000, "--api-port"),
        data_dir=Path(data_dir).expanduser() if data_dir else None,
        secret_file=args.secret_file or cfg.secret_file,
        config_source=source,
    )


def print_results(results: list[Check], ctx: Context, console=None) -> None:
    """One block per check: ``STATUS  name  summary`` and a ``fix:`` line, wrapped to the
    terminal at word boundaries (paths are never split), the status coloured on a TTY."""
    import textwrap

    from rich.console import Console
    from rich.text import Text

    console = console or Console(highlight=False)
    width = max(60, console.width)
    head = (f"ringlet doctor · ringlet {versions.RELEASE} (wire protocol {versions.PROTOCOL_VERSION}) · "
            f"{platform.system().lower()} {platform.machine()} · Python "
            f"{platform.python_version()} · {sys.executable}")
    console.print(Text(head, style="bold"), soft_wrap=True)
    if ctx.config_source:
        console.print(Text(f"using the service configuration {ctx.config_source} (options override it)",
                           style="dim"), soft_wrap=True)
    styles = {OK: "bold green", WARN: "bold yellow", FAIL: "bold red"}
    name_w = max(len(r.name) for r in results) if results else 0
    indent = " " * (6 + name_w + 2)

    def wrap(text: str, first: str) -> list[str]:
        return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=indent,
                             break_long_words=False, break_on_hyphens=False) or [first]

    for r in results:
        lines = wrap(r.summary, indent)
        if r.fix:
            lines += wrap("fix: " + r.fix, indent)
        first = Text.assemble((f"{r.status:<6}", styles[r.status]), f"{r.name:<{name_w}}  ",
                              lines[0][len(indent):])
        console.print(first, soft_wrap=True)
        for line in lines[1:]:
            console.print(Text(line, style="bold" if line.lstrip().startswith("fix:") else ""), soft_wrap=True)
    warns = sum(r.status == WARN for r in results)
    fails = sum(r.status == FAIL for r in results)
    console.print(Text(f"{len(results)} checks: {len(results) - warns - fails} OK, {warns} WARN, {fails} FAIL",
                       style="bold red" if fails else "bold yellow" if warns else "bold green"))


def run_doctor(args: argparse.Namespace) -> int:
    ctx = make_context(args)
    results = run_checks(ctx)
    if args.json:
        print(json.dumps({"checks": [asdict(r) for r in results],
                          "failed": any(r.status == FAIL for r in results)}, indent=2, default=str))
    else:
        print_results(results, ctx)
    return 1 if any(r.status == FAIL for r in results) else 0
