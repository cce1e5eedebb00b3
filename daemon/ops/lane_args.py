"""The command line of one model's lane: ``ringlet run`` as given, for one model.

A daemon started with several ``--model`` runs one lane per model (:mod:`.lanes`): a
``ringlet run`` child process serving that model alone. Its command line is the parent's
with the options that name the model, its ports, its data directory and its cluster
replaced; everything else (secrets, API keys, limits, policy, interfaces) is passed on as
given, so a lane behaves as the single-model daemon of the same flags does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["LANE_OPTIONS", "lane_argv", "lane_key", "option_values", "shifted_peers", "strip_options"]

#: ``run`` options the parent sets per lane (each takes a value).
LANE_OPTIONS = ("--model", "--model-alias", "--model-context", "--port", "--api-port", "--api-host", "--data-dir",
                "--cluster", "--lane-share-file", "--lane-supervisor", "--public-api-url", "--peers")
#: ``run`` options a lane never gets (flags without a value).
LANE_FLAGS = ("--no-dashboard",)


def lane_key(model: str) -> str:
    """The name every node gives the lane of ``model`` as written on the command line (the
    same command on every machine gives the same key): a path's last part without a
    ``.gguf`` suffix, a Hub name without its revision. Used in the lane's cluster name, so
    the lanes of one model find each other and no other model's."""
    text = model.strip().rstrip("/")
    if "@" in text and not Path(text).exists():
        text = text.split("@", 1)[0]
    name = text.rsplit("/", 1)[-1] if Path(text).exists() or text.count("/") != 1 else text.replace("/", "--")
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name) or "model"


def strip_options(argv: list[str], options: tuple[str, ...], flags: tuple[str, ...] = ()) -> list[str]:
    """``argv`` without ``options`` (``--opt value`` or ``--opt=value``) and ``flags``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            continue
        if name in options:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def option_values(argv: list[str], option: str) -> list[str]:
    """Every value of ``option`` in ``argv`` (``--opt value`` or ``--opt=value``)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith(option + "="):
            out.append(arg.split("=", 1)[1])
    return out


def shifted_peers(spec: str, index: int) -> str:
    """``--peers`` for lane ``index``: each peer's lane of the same priority listens at its
    node's ``--port`` + ``index`` (:class:`~.lanes.Lanes`).

    Raises:
        ValueError: a malformed ``--peers`` (as ``ringlet run`` reports it).
    """
    from ringlet.daemon.cluster.static_peers import parse_peers

    return ",".join(f"[{h}]:{p + index}" if ":" in h else f"{h}:{p + index}" for h, p in parse_peers(spec))


def lane_argv(run_argv: list[str], *, model: str, grpc_port: int, api_port: int, data_dir: Path, cluster: str,
              share_file: Path | None, supervisor_url: str, public_api_url: str, index: int = 0,
              context: int | None = None) -> list[str]:
    """The child's full command: ``python -m ringlet.daemon.ops.cli`` + the parent's global
    options and ``run`` options (``run_argv``: everything after the program name) with the
    lane's own model, ports (API on 127.0.0.1), data directory, cluster name, ``--peers``
    (each peer's port + ``index``, the lane's priority) and, when given, its ``--context``
    (the model's ``--model-context``: the last ``--context`` is the one ``run`` takes)."""
    peers = option_values(run_argv, "--peers")
    args = strip_options(run_argv, LANE_OPTIONS, LANE_FLAGS)
    lane = ["--model", model, "--port", str(grpc_port), "--api-host", "127.0.0.1", "--api-port", str(api_port),
            "--data-dir", str(data_dir), "--cluster", cluster, "--no-dashboard",
            "--lane-supervisor", supervisor_url, "--public-api-url", public_api_url]
    if share_file is not None:
        lane += ["--lane-share-file", str(share_file)]
    if peers:
        lane += ["--peers", shifted_peers(peers[-1], index)]
    if context is not None:
        lane += ["--context", str(context)]
    return [sys.executable, "-m", "ringlet.daemon.ops.cli", *args, *lane]
