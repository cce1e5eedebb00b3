"""The ``ringlet service`` command line: its parser (``install``, ``uninstall``,
``status``, ``upgrade`` and their options) and the dispatch to the action given."""

from __future__ import annotations

import argparse

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.service.install import install, uninstall
from ringlet.daemon.ops.service.paths import CONFIG_NAME, TARGETS
from ringlet.daemon.ops.service.status import status
from ringlet.daemon.ops.service.upgrade import add_upgrade_parser, upgrade


def add_service_parser(subparsers) -> None:
    """Register ``ringlet service`` with its four actions."""
    service = subparsers.add_parser(
        "service", help="install ringlet as a login service (launchd agent / systemd user unit)",
        description="Install, remove, inspect or upgrade the ringlet service of this user.")
    actions = service.add_subparsers(dest="service_action", metavar="ACTION")
    inst = actions.add_parser("install", help="write the configuration and the service, then start it",
                              description="Options are merged into the existing configuration "
                                          f"({'~/.config/ringlet/' + CONFIG_NAME}); give an empty value to unset one.")
    inst.add_argument("--cluster", help="cluster name")
    inst.add_argument("--secret-file", help="cluster secret file (ringlet secret new FILE)")
    inst.add_argument("--model", action="append", metavar="MODEL",
                      help="model directory, .gguf file, Hub name or short name; repeat it to serve several "
                           "models, the first first (replaces the configured ones)")
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
    add_upgrade_parser(actions)


def run_service(args: argparse.Namespace) -> int:
    action = getattr(args, "service_action", None)
    if action == "install":
        return install(args)
    if action == "uninstall":
        return uninstall(args)
    if action == "status":
        return status(args)
    if action == "upgrade":
        return upgrade(args)
    raise RingletError("ringlet service: give an action: install, uninstall, status or upgrade")
