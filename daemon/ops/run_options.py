"""The ``ringlet run`` options: one parser definition for the CLI and for ``ringlet service``.

``ringlet service install`` checks the arguments it writes into a service with this
same parser (:func:`run_only_parser`), so a service never starts with an option its
``ringlet run`` rejects. Importing this module imports no engine code, so
``ringlet --help`` stays fast.
"""

from __future__ import annotations

import argparse

from ringlet.daemon.engine.defaults import (
    CPU_PREFILL_CHUNK,
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PREFILL_SHARE,
)
from ringlet.daemon.engine.drafting import DEFAULT_SPEC_TOKENS
from ringlet.daemon.engine.dtype import CHOICES as DTYPE_CHOICES
from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.secret import add_run_arguments, positive_int

DEFAULT_GRPC_PORT = 7100
DEFAULT_API_PORT = 8000
#: ``--drain-timeout-s``: long enough for a short reply to finish and a re-plan to be
#: committed (a second or two here); below systemd's TimeoutStopSec and launchd's
#: ExitTimeOut in the service units, so the drain ends before they kill the daemon.
DRAIN_TIMEOUT_S = 20.0


def parse_size(text: str | None, option: str = "--memory-limit", allow_zero: bool = False) -> int | None:
    """``"4GB"``, ``"512MiB"``, ``"1e9"`` -> bytes (``None`` for ``None``).

    Raises:
        RingletError: not a size, or not positive (zero too, unless ``allow_zero``);
            the message names ``option``.
    """
    if text is None:
        return None
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise RingletError(f"{option}: {text!r} is not a size (e.g. 8GB, 512MiB)") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise RingletError(f"{option} must be positive" + (" or 0" if allow_zero else ""))
    return int(value)


def _share(text: str) -> float:
    """``--prefill-share``: a fraction in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def add_model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    """``--model``, ``--dtype`` and ``--threads``, shared by ``run``, ``generate`` and ``demo``
    (``several``: ``--model`` may be repeated, into ``models``; ``model`` is then the first)."""
    if several:
        p.add_argument("--model", dest="models", action="append", default=None,
                       help="model path (MLX/HF directory or .gguf), short name or Hub ORG/NAME (default: "
                            "smollm2-135m); repeat it to serve several models, in priority order: each gets a "
                            "ring in the memory the ones before it leave")
    else:
        p.add_argument("--model", default=None,
                       help="model path (MLX/HF directory or .gguf) or short name (default: smollm2-135m)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights' precision: auto (default: float32 on a CPU when the model fits that way, "
                        "else the model's own), native (the model's own), float32, float16, bfloat16")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="BLAS threads of this process (default: $RINGLET_THREADS, else the cores / the ringlet "
                        "processes on this machine)")
    p.add_argument("--weights-cache-bytes", default=None, metavar="SIZE",
                   help="disk budget of the machine's cache of dequantized weights (default 32GB, at most a "
                        "quarter of the free space; 0 turns it off)")


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """``-v`` and ``--log-json``, which stand before the subcommand."""
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logging")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines (for services)")


def add_run_parser(sub) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand (the daemon) to ``sub`` (an argparse subparsers action)."""
    run = sub.add_parser("run", help="run the daemon (a node of the cluster)")
    add_model_args(run, several=True)
    run.add_argument("--model-alias", action="append", default=None, metavar="NAME=MODEL",
                     help="another name requests may give for one of the --model values, e.g. "
                          "claude-haiku=smollm2-135m (repeatable)")
    run.add_argument("--model-context", action="append", default=None, metavar="MODEL=TOKENS",
                     help="context tokens to size one model's KV caches for, e.g. Qwen3-4B=32768 (MODEL: a "
                          "--model value or its short key; repeatable; the others take --context)")
    run.add_argument("--host", default="127.0.0.1", help="gRPC address to bind and advertise (default 127.0.0.1)")
    run.add_argument("--port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port")
    run.add_argument("--api-host", default="127.0.0.1", help="HTTP API bind address")
    run.add_argument("--api-port", type=int, default=DEFAULT_API_PORT, help="HTTP API port")
    run.add_argument("--plan", default=None,
                     help="static plan, ring order: HOST:PORT=START:END,... (half-open layer ranges); "
                          "without it the cluster forms by discovery and negotiated plans")
    run.add_argument("--no-dashboard", action="store_true",
                     help="do not draw the live dashboard (it is shown when stdout is a terminal)")
    run.add_argument("--fetch-model", action="store_true",
                     help="the model is not on this machine: pull its shards from a member (negotiated mode)")
    run.add_argument("--advertise-host", default=None, help="address peers dial (default: --host)")
    run.add_argument("--cluster", default="ringlet", help="cluster name; nodes of other clusters are ignored")
    run.add_argument("--data-dir", default=None, help="node id, caches (default: ~/.local/share/ringlet)")
    run.add_argument("--interface", action="append", default=None,
                     help="mDNS on this interface or IPv4 address (repeatable; default: every multicast "
                          "interface; 127.0.0.1 for a cluster on one machine)")
    run.add_argument("--peers", default=None, help="HOST:PORT,... to dial directly where multicast is blocked")
    run.add_argument("--no-mdns", action="store_true", help="do not advertise or browse mDNS (use --peers)")
    run.add_argument("--memory-limit", default=None, help="usable memory to offer the cluster, e.g. 8GB")
    run.add_argument("--policy", choices=["balanced", "memory", "latency"], default="balanced",
                     help="planner policy (default balanced)")
    run.add_argument("--prefill-share", type=_share, default=DEFAULT_PREFILL_SHARE,
                     help="balanced policy: how much of the stages' time is prefill (long prompts) rather than "
                          f"decode, 0..1 (default {DEFAULT_PREFILL_SHARE}: both weigh the same)")
    run.add_argument("--context", type=int, default=None, help="context tokens to size KV caches for")
    run.add_argument("--mode", choices=["auto", "pipeline", "tensor", "hybrid"], default="auto",
                     help="auto (default: decided from memory, links and predicted speed), pipeline, tensor "
                          "(tensor parallel over MLX distributed whenever the members can; else the pipeline, "
                          "saying why), or hybrid (tensor groups chained as pipeline stages; needs 4+ members "
                          "in equal groups whose size the heads divide by)")
    run.add_argument("--heartbeat-s", type=float, default=0.5, help="seconds between heartbeats")
    run.add_argument("--remove-after-s", type=float, default=2.0,
                     help="a member silent this long is removed and the cluster re-plans")
    run.add_argument("--drain-timeout-s", type=float, default=DRAIN_TIMEOUT_S,
                     help="on SIGTERM, seconds at most to finish this node's API requests, tell the peers and "
                          "wait for their plan without this node, before exiting")
    run.add_argument("--link-refresh-s", type=float, default=30.0,
                     help="seconds between measurements of every member's links, at each of its addresses "
                          "(the fastest that answers is used; default 30)")
    run.add_argument("--settle-s", type=float, default=0.3, help="membership quiet time before re-planning")
    run.add_argument("--initial-settle-s", type=float, default=1.0, help="quiet time before the first plan")
    run.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH,
                     help=f"most decode steps a stage runs as one batch (1: no batching; default {DEFAULT_MAX_BATCH})")
    run.add_argument("--spec-tokens", type=int, default=DEFAULT_SPEC_TOKENS, metavar="K",
                     help="speculative decoding: most tokens stage 0 drafts per decode step from the prompt, "
                          "the output and a request's prediction, verified in one trip "
                          f"(0: off; default {DEFAULT_SPEC_TOKENS})")
    run.add_argument("--draft-model", default=None, metavar="MODEL",
                     help="speculative decoding: a small model with the served model's tokenizer that drafts "
                          "when the prompt, output and prediction give no draft; loaded whole by each node, run "
                          "by stage 0's (same forms as --model; default: none)")
    run.add_argument("--prefill-chunk", type=positive_int, default=None,
                     help=f"prompt tokens per prefill chunk (default {CPU_PREFILL_CHUNK} on a CPU, "
                          f"{DEFAULT_PREFILL_CHUNK} on a GPU)")
    run.add_argument("--prefix-cache-bytes", default=None, metavar="SIZE",
                     help="KV of finished requests each stage keeps for later turns, e.g. 2GB (default: a quarter "
                          "of the memory the stage's weights leave free; 0: off)")
    run.add_argument("--prefix-cache-disk-bytes", default="0", metavar="SIZE",
                     help="spill prefix cache entries evicted from memory to the data dir, up to this many bytes, "
                          "e.g. 20GB; they are reloaded on a hit and survive a restart (default 0: off)")
    run.add_argument("--prefix-cache-scope", choices=["key", "cluster"], default="key",
                     help="with --api-key-file, keep cached prefixes per API key (key, default) or shared by "
                          "every caller (cluster)")
    run.add_argument("--kv-migration", choices=["on", "off"], default="on",
                     help="on a re-plan, move the KV caches of requests in flight and of cached prefixes with "
                          "their layers (on, default), or drop them and re-prefill (off)")
    run.add_argument("--boundary-cache-bytes", default=None, metavar="SIZE",
                     help="hidden states each stage keeps of what it sent on, so that a lost next stage's layers "
                          "are rebuilt from them instead of re-prefilling every request, e.g. 4GB (default 1GB; "
                          "0: off)")
    run.add_argument("--node-id", default="", help=argparse.SUPPRESS)
    # a model's lane of a daemon serving several models (ops/lanes.py): set by its parent
    run.add_argument("--lane-share-file", default=None, help=argparse.SUPPRESS)
    run.add_argument("--lane-supervisor", default=None, help=argparse.SUPPRESS)
    run.add_argument("--public-api-url", default=None, help=argparse.SUPPRESS)
    add_run_arguments(run)  # --secret-file, --api-key-file, limits
    return run


def run_only_parser() -> argparse.ArgumentParser:
    """``ringlet`` with its global options and the ``run`` subcommand alone."""
    parser = argparse.ArgumentParser(prog="ringlet")
    add_global_options(parser)
    add_run_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser
