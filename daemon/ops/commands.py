"""Operator commands: ``ringlet dashboard``, ``service``, ``doctor``, ``status``.

A ``ringlet`` CLI extension (see :mod:`ringlet.daemon.ops.cli`): ``COMMANDS``,
``add_parsers(subparsers)``, ``run(args) -> int``. The modules doing the work are
imported only when their command runs, so ``ringlet --help`` stays fast. Bad
input ends in one ``error: ...`` line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse

COMMANDS = frozenset({"dashboard", "service", "doctor", "status"})

_API_HELP = ("a node's API base URL (default: this machine's service, else http://127.0.0.1:8000); repeat it "
             "to add nodes whose URLs the cluster does not report")
_KEY_HELP = ("send the first key of this file as a bearer key (nodes run with --api-key-file); "
             "default: $RINGLET_API_KEY")


def add_parsers(subparsers) -> None:
    """Register the four commands on ``ringlet``'s subparsers."""
    d = subparsers.add_parser(
        "dashboard", help="live terminal view of the cluster: ring, nodes, requests, events",
        description="A live view of the cluster, redrawn twice a second. Press q or Ctrl-C to leave.")
    d.add_argument("--api", action="append", metavar="URL", help=_API_HELP)
    d.add_argument("--api-key-file", default=None, metavar="FILE", help=_KEY_HELP)
    d.add_argument("--once", action="store_true",
                   help="print one frame and exit (scripts, tests); exit status 1 when no node answers")
    d.add_argument("--interval", default="0.5", metavar="S", help="seconds between refreshes (default 0.5)")
    d.add_argument("--inline", action="store_true",
                   help="draw in the terminal's scrollback instead of the alternate screen")

    s = subparsers.add_parser(
        "status", help="the cluster's state for scripts (same data as the dashboard)",
        description="One snapshot of the cluster. Exit status: 0 every stage ready, 1 no node answered, "
                    "3 reachable but some stage not ready.")
    s.add_argument("--api", action="append", metavar="URL", help=_API_HELP)
    s.add_argument("--api-key-file", default=None, metavar="FILE", help=_KEY_HELP)
    s.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    s.add_argument("--timeout", default="2", metavar="S", help="seconds to wait for each node (default 2)")

    from ringlet.daemon.ops.service.command import add_service_parser

    add_service_parser(subparsers)

    from ringlet.daemon.ops.doctor.command import add_doctor_parser

    add_doctor_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    """Run one of :data:`COMMANDS`."""
    if not getattr(args, "verbose", 0):
        # one-shot commands: the daemon modules they import log INFO lines nobody asked for
        import logging

        logging.getLogger("ringlet").setLevel(logging.WARNING)
    if args.command == "dashboard":
        from ringlet.daemon.ops.dashboard.live import run_dashboard

        return run_dashboard(args)
    if args.command == "status":
        from ringlet.daemon.errors import RingletError
        from ringlet.daemon.ops.status.command import run_status

        try:
            args.timeout = float(args.timeout)
        except ValueError:
            raise RingletError(f"--timeout {args.timeout!r}: not a number of seconds") from None
        if not 0 < args.timeout <= 300:
            raise RingletError(f"--timeout {args.timeout}: give between 0 and 300 seconds")
        return run_status(args)
    if args.command == "service":
        from ringlet.daemon.ops.service.command import run_service

        return run_service(args)
    if args.command == "doctor":
        from ringlet.daemon.ops.doctor.command import run_doctor

        return run_doctor(args)
    raise ValueError(f"unknown command {args.command!r}")
