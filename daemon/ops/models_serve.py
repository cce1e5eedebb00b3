"""``ringlet models load | unload``: change the models a running cluster serves.

A node started with several ``--model`` (or a ``--model-alias``) serves each model in its
own lane (:mod:`.lanes`); ``load`` adds a model at the lowest priority and ``unload``
removes one, on the node named by ``--api`` and, through it, on every member
(``POST /v1/models/load`` / ``unload``, :mod:`.lane_sync`).
"""

from __future__ import annotations

import argparse
import sys

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.run_options import DEFAULT_API_PORT

__all__ = ["add_serve_parsers", "run_serve"]


def add_serve_parsers(sub) -> None:
    """Add ``load`` and ``unload`` to ``ringlet models``' subparsers ``sub``."""
    for name, text in (("load", "serve one more model on the running cluster (lowest priority), on every member"),
                       ("unload", "stop serving a model on the running cluster, on every member")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("model", metavar="MODEL", help="a model path, short name or ORG/NAME (unload: its name)")
        if name == "load":
            p.add_argument("--alias", action="append", default=None, metavar="NAME",
                           help="another name requests may give for it (repeatable)")
        p.add_argument("--api", default=f"http://127.0.0.1:{DEFAULT_API_PORT}", help="a node's API base URL")
        p.add_argument("--api-key-file", default=None, metavar="FILE",
                       help="send the first key of this file (nodes run with --api-key-file)")


def run_serve(args: argparse.Namespace) -> int:
    """Run ``ringlet models load|unload``; prints what each member answered."""
    import httpx

    from ringlet.daemon.wire.auth import client_api_key

    key = client_api_key(args.api_key_file) if args.api_key_file else client_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": args.model}
    if args.models_command == "load":
        body["aliases"] = args.alias or []
    url = f"{args.api.rstrip('/')}/v1/models/{args.models_command}"
    try:
        r = httpx.post(url, json=body, headers=headers, timeout=120)
    except httpx.HTTPError as exc:
        raise RingletError(f"{args.api}: no answer ({exc}); is the node running?") from None
    try:
        answer = r.json()
    except ValueError:
        answer = {}
    if r.status_code >= 400:
        message = (answer.get("error") or {}).get("message") if isinstance(answer.get("error"), dict) else None
        raise RingletError(message or answer.get("error") or f"{r.status_code}: {r.text[:300]}")
    done = "loading" if args.models_command == "load" else "unloaded"
    print(f"{answer.get('model', args.model)}: {done} on this node")
    for member, result in sorted((answer.get("members") or {}).items()):
        print(f"  {member}: {result}")
    if not answer.get("members"):
        print("  (no other member known yet: they take the set when they next look)", file=sys.stderr)
    return 0
