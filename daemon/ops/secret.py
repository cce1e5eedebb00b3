"""``ringlet secret``: make and inspect cluster secrets; the security flags of ``ringlet run``.

``ringlet secret new [PATH] [--force]`` writes a fresh secret (64 hex chars,
mode 0600; default ``<data dir>/cluster.secret``). Copy that file to every
node over a channel you trust (scp, a config manager) and start each daemon
with ``--secret-file PATH``. ``ringlet secret fingerprint PATH`` prints the
secret's short fingerprint, which every node also logs at start: equal
fingerprints mean equal secrets.

:func:`add_run_arguments` adds the secret, API key and limit flags to ``ringlet
run``; :func:`transport_config` and :func:`api_limits` turn them into the
settings of the gRPC plane and the HTTP API.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ringlet.daemon.wire.auth import DEFAULT_WINDOW_S, fingerprint, load_api_keys, load_secret, write_secret
from ringlet.daemon.wire.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_QUEUE,
    ApiLimits,
)
from ringlet.daemon.wire.transport import DEFAULT_MAX_MESSAGE_BYTES, TransportConfig

COMMANDS = frozenset({"secret"})


def _default_path() -> Path:
    from ringlet.daemon.paths import default_data_dir

    return default_data_dir() / "cluster.secret"


def add_parsers(subparsers) -> None:
    """Register ``ringlet secret``."""
    p = subparsers.add_parser("secret", help="make or inspect the cluster secret (--secret-file of ringlet run)")
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    new = sub.add_parser("new", help="write a new secret with mode 0600")
    new.add_argument("path", nargs="?", default=None, help=f"where to write it (default {_default_path()})")
    new.add_argument("--force", action="store_true", help="replace an existing file")
    fp = sub.add_parser("fingerprint", help="print a secret's fingerprint (equal on nodes sharing the secret)")
    fp.add_argument("path", help="the secret file")


def run(args: argparse.Namespace) -> int:
    """Run ``ringlet secret ...``. Errors raise RingletError (printed by the CLI)."""
    if args.action == "new":
        path = write_secret(Path(args.path) if args.path else _default_path(), force=args.force)
        print(f"wrote a new cluster secret to {path} (mode 0600, fingerprint {fingerprint(load_secret(path))})")
        print("copy it to every node over a trusted channel and start each with: "
              f"ringlet run --secret-file {path}", file=sys.stderr)
        return 0
    if args.action == "fingerprint":
        print(fingerprint(load_secret(args.path)))
        return 0
    print("usage: ringlet secret {new [PATH] [--force] | fingerprint PATH}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- ringlet run


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_run_arguments(run_parser: argparse.ArgumentParser) -> None:
    """Add the security and limit flags to the ``ringlet run`` parser."""
    g = run_parser.add_argument_group("security and limits")
    g.add_argument("--secret-file", default=None,
                   help="cluster secret (make one with `ringlet secret new`): TLS and per-call authentication "
                        "on gRPC, signed mDNS adverts. Without it the cluster runs open")
    g.add_argument("--api-key-file", default=None,
                   help="file of API keys, one per line: /v1/* then requires 'Authorization: Bearer <key>'")
    g.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest HTTP request body (default {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="largest prompt in tokens (default: the model's context)")
    g.add_argument("--max-completion-tokens", type=positive_int, default=None,
                   help="clamp max_tokens to this (default: what the context leaves)")
    g.add_argument("--max-concurrent-requests", type=positive_int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                   help=f"generations this node's API runs at once (default {DEFAULT_MAX_CONCURRENT_REQUESTS})")
    g.add_argument("--max-queue", type=_non_negative_int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests waiting for a slot; beyond, HTTP 429 (default {DEFAULT_MAX_QUEUE})")
    g.add_argument("--max-message-bytes", type=positive_int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help=f"largest gRPC message (default {DEFAULT_MAX_MESSAGE_BYTES})")
    g.add_argument("--control-rpc-rate", type=_positive_float, default=TransportConfig.control_rate_per_s,
                   help="control RPCs per second allowed per peer (default %(default)s)")
    g.add_argument("--auth-window", type=_positive_float, default=DEFAULT_WINDOW_S,
                   help="seconds a call token stays valid either side of this node's clock (default %(default)s)")


def transport_config(args: argparse.Namespace, node_id: str = "") -> TransportConfig:
    """The gRPC settings from ``ringlet run`` flags (reads the secret file).

    Raises:
        SecretError: the secret file is missing, too open, or malformed.
    """
    secret_file = getattr(args, "secret_file", None)
    rate = getattr(args, "control_rpc_rate", TransportConfig.control_rate_per_s)
    return TransportConfig(
        secret=load_secret(secret_file) if secret_file else None,
        node_id=node_id,
        max_message_bytes=getattr(args, "max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES),
        control_rate_per_s=rate,
        control_burst=max(1, int(2 * rate)),
        auth_window_s=getattr(args, "auth_window", DEFAULT_WINDOW_S),
    )


def api_limits(args: argparse.Namespace) -> ApiLimits:
    """The HTTP API limits from ``ringlet run`` flags (reads the API key file).

    Raises:
        SecretError: the API key file is missing, too open, or malformed.
    """
    key_file = getattr(args, "api_key_file", None)
    return ApiLimits(
        api_key_digests=load_api_keys(key_file) if key_file else (),
        max_body_bytes=getattr(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES),
        max_prompt_tokens=getattr(args, "max_prompt_tokens", None),
        max_completion_tokens=getattr(args, "max_completion_tokens", None),
        max_concurrent_requests=getattr(args, "max_concurrent_requests", DEFAULT_MAX_CONCURRENT_REQUESTS),
        max_queue=getattr(args, "max_queue", DEFAULT_MAX_QUEUE),
    )
