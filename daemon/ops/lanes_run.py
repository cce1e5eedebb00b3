"""``ringlet run --model A --model B``: the node's lanes and the API in front of them.

Runs :class:`~.lanes.Lanes` (one child daemon per model, memory shared by priority), the
members' agreement on the set of models (:class:`~.lane_sync.ModelSync`) and the node's API
(:func:`ringlet.daemon.api.front.create_front_app`) until SIGINT/SIGTERM, then stops the
lanes, each draining its requests and leaving its ring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.run_options import DRAIN_TIMEOUT_S, parse_size
from ringlet.daemon.ops.terminal import drawn, own_dashboard

log = logging.getLogger("ringlet.daemon.lanes")

__all__ = ["parse_aliases", "parse_model_contexts", "several_models", "serve_lanes"]


def several_models(args) -> bool:
    """Whether ``ringlet run``'s ``args`` ask for lanes: two or more ``--model``, or an alias."""
    return len(getattr(args, "models", None) or []) > 1 or bool(getattr(args, "model_alias", None))


def parse_aliases(values: list[str] | None, models: list[str]) -> dict[str, str]:
    """``--model-alias NAME=MODEL`` values -> ``{NAME: --model value}``; MODEL is a
    ``--model`` value or its short key (:func:`~.lane_args.lane_key`).

    Raises:
        RingletError: a value without ``=``, or a MODEL that is not served.
    """
    out: dict[str, str] = {}
    for value in values or []:
        name, sep, target = value.partition("=")
        if not sep or not name.strip() or not target.strip():
            raise RingletError(f"--model-alias {value!r}: write NAME=MODEL, e.g. claude-haiku=smollm2-135m")
        out[name.strip()] = _served(target.strip(), models, f"--model-alias {value!r}")
    return out


def parse_model_contexts(values: list[str] | None, models: list[str]) -> dict[str, int]:
    """``--model-context MODEL=TOKENS`` values -> ``{--model value: context tokens}``; MODEL
    is a ``--model`` value or its short key, TOKENS a positive integer.

    Raises:
        RingletError: a value without ``=``, TOKENS not a positive integer, or a MODEL that
            is not served.
    """
    out: dict[str, int] = {}
    for value in values or []:
        target, sep, tokens = value.rpartition("=")
        if not sep or not target.strip():
            raise RingletError(f"--model-context {value!r}: write MODEL=TOKENS, e.g. smollm2-135m=8192")
        try:
            n = int(tokens)
        except ValueError:
            n = 0
        if n <= 0:
            raise RingletError(f"--model-context {value!r}: {tokens!r} is not a positive number of tokens")
        out[_served(target.strip(), models, f"--model-context {value!r}")] = n
    return out


def _served(name: str, models: list[str], what: str) -> str:
    """The ``--model`` value ``name`` means (the value itself or its short key)."""
    from ringlet.daemon.ops.lane_args import lane_key

    match = [m for m in models if name in (m, lane_key(m))]
    if not match:
        raise RingletError(f"{what}: {name!r} is not one of the --model values ({', '.join(models)})")
    return match[0]


def _usable_bytes(args) -> int:
    """What a single daemon would offer here: the memory probe's figure, or
    ``--memory-limit`` where lower."""
    from ringlet.daemon.ops.memory_follow import offered_memory
    from ringlet.daemon.probes.memory import probe_memory

    return offered_memory(probe_memory(), parse_size(getattr(args, "memory_limit", None)))[0]


async def serve_lanes(args, run_argv: list[str]) -> int:
    """Run the node's lanes and its API until SIGINT/SIGTERM. Returns the exit code."""
    import uvicorn

    from ringlet.daemon.api.front import create_front_app
    from ringlet.daemon.ops.client import auth_headers
    from ringlet.daemon.ops.draining import DrainingServer
    from ringlet.daemon.ops.lane_sync import ModelSync
    from ringlet.daemon.ops.lanes import Lanes
    from ringlet.daemon.paths import default_data_dir
    from ringlet.daemon.wire.auth import client_api_key, load_api_keys

    if getattr(args, "plan", None):
        raise RingletError("--plan serves one model; several --model need negotiated plans (drop --plan)")
    models = list(args.models or [])
    aliases = parse_aliases(getattr(args, "model_alias", None), models)
    contexts = parse_model_contexts(getattr(args, "model_context", None), models)
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    local = "127.0.0.1" if args.api_host in ("0.0.0.0", "", "127.0.0.1") else args.api_host  # noqa: S104
    public_host = local if local != "127.0.0.1" else (args.advertise_host or args.host or "127.0.0.1")
    if public_host in ("0.0.0.0", ""):  # noqa: S104 - comparison
        public_host = "127.0.0.1"
    key_file = getattr(args, "api_key_file", None)
    key = client_api_key(key_file) if key_file else None
    headers = auth_headers(key)
    lanes = Lanes(run_argv, models, aliases, grpc_port=args.port, data_dir=data_dir, cluster=args.cluster,
                  usable_bytes=_usable_bytes(args), public_api_url=f"http://{public_host}:{args.api_port}",
                  supervisor_url=f"http://{local}:{args.api_port}", headers=headers, contexts=contexts)
    sync = ModelSync(lanes, data_dir / "models.json", f"http://{public_host}:{args.api_port}", headers)
    sync.restore()
    from ringlet.daemon.ops.secret import api_limits

    app = create_front_app(lanes, load_api_keys(key_file) if key_file else (), sync,
                           max_body_bytes=api_limits(args).max_body_bytes)
    drain_s = float(getattr(args, "drain_timeout_s", DRAIN_TIMEOUT_S))
    server = DrainingServer(uvicorn.Config(app, host=args.api_host, port=args.api_port, log_level="warning",
                                           lifespan="off", access_log=False, timeout_graceful_shutdown=drain_s))
    log.info("node: %d model(s) %s, API http://%s:%d, cluster %r", len(lanes.lanes),
             ", ".join(f"{lane.key}{' (' + ', '.join(lane.aliases) + ')' if lane.aliases else ''}"
                       for lane in lanes.lanes), args.api_host, args.api_port, args.cluster)
    lanes.log_prefix = not getattr(args, "log_json", False)
    started = time.monotonic()
    await lanes.start()
    syncing = asyncio.create_task(sync.run(), name="models-sync")
    try:
        async with drawn(own_dashboard(args)):  # in a terminal, as a single-model node draws it
            await server.serve()
    finally:
        syncing.cancel()
        with contextlib.suppress(Exception):
            await lanes.stop(timeout_s=drain_s + 10.0)
    log.info("stopped after %.0f s", time.monotonic() - started)
    return 0
