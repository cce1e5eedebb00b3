"""``ringlet plan``: run the planner on a nodes file and a model config, print the plan.

    ringlet plan --nodes nodes.json --model PATH_OR_CONFIG [--model ...] [--policy balanced|memory|latency]
                 [--context N] [--tolerance F] [--previous plan.json] [--model-overhead BYTES] [--json]

The nodes file is JSON::

    {"nodes": [{"node_id": "m1", "memory": "480 GiB", "bandwidth": "819 GB/s", "flops": "28 TFLOPS"}, ...],
     "links": [{"a": "m1", "b": "m2", "bandwidth": "80 Gb/s", "latency": "50 us", "kind": "tb5"}, ...],
     "policy": {"fallback_bandwidth": "10 Gb/s", "fallback_latency": "200 us"}}

Numbers are plain (bytes, bytes/s, s, FLOP/s) under the planner's field names
(``memory_bytes``, ``bandwidth_bytes_per_s``, ``latency_s``, ``flops``) or strings with
units under the short names: bytes ``B kB MB GB TB KiB MiB GiB TiB``; bandwidth
``.../s`` in bytes (``GB/s``) or bits (``Gb/s``, ``Gbit/s``); latency ``ns us ms s``;
compute ``FLOPS`` with an SI prefix. ``--model`` is a ``config.json``, a model
directory, or inline JSON. ``--model`` repeated places several models together in the
nodes' pooled memory, highest priority first (:mod:`.plan_models`). Exit status: 0 plan
printed, 1 the model (one of the models) does not fit, 2 bad input (one ``error:`` line
on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ringlet.daemon.engine.defaults import DEFAULT_PREFILL_SHARE
from ringlet.daemon.ops.plan_models import print_placement, read_previous
from ringlet.partitioning import (
    POLICY_NAMES,
    Infeasible,
    LinkSpec,
    NodeSpec,
    Plan,
    Policy,
    make_plan,
    place_models,
)

EXIT_OK, EXIT_INFEASIBLE, EXIT_BAD_INPUT = 0, 1, 2

_SI = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_TIME = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


class InputError(ValueError):
    """Bad command-line input; the message is the one line printed."""


def parse_bytes(value: Any, what: str) -> float:
    """``480 GiB`` / ``512GB`` / a number -> bytes."""
    if not isinstance(value, str):
        return _plain(value, what)
    m = re.fullmatch(_NUM + r"(Ki|Mi|Gi|Ti|Pi|[kKMGTP]?)B?\s*", value)
    if not m:
        raise InputError(f"{what}: cannot read {value!r} as bytes (e.g. 480 GiB, 512 GB)")
    unit = m.group(2)
    return float(m.group(1)) * (_BIN.get(unit) or _SI[unit])


def parse_bandwidth(value: Any, what: str) -> float:
    """``819 GB/s`` (bytes) / ``80 Gb/s`` or ``80 Gbit/s`` (bits) / a number -> bytes/s."""
    if not isinstance(value, str):
        return _plain(value, what)
    m = re.fullmatch(_NUM + r"([kKMGTP]?)(B|b|bit|bits)(?:/s|ps)\s*", value)
    if not m:
        raise InputError(f"{what}: cannot read {value!r} as a bandwidth (e.g. 819 GB/s, 80 Gb/s)")
    scale = _SI[m.group(2)] / (1 if m.group(3) == "B" else 8)
    return float(m.group(1)) * scale


def parse_seconds(value: Any, what: str) -> float:
    """``50 us`` / ``1 ms`` / a number -> seconds."""
    if not isinstance(value, str):
        return _plain(value, what)
    m = re.fullmatch(_NUM + r"(ns|us|µs|ms|s)\s*", value)
    if not m:
        raise InputError(f"{what}: cannot read {value!r} as a time (e.g. 50 us, 1 ms)")
    return float(m.group(1)) * _TIME[m.group(2)]


def parse_flops(value: Any, what: str) -> float:
    """``28.4 TFLOPS`` / a number -> FLOP/s."""
    if not isinstance(value, str):
        return _plain(value, what)
    m = re.fullmatch(_NUM + r"([kKMGTP]?)(?:FLOPS|FLOP/s|flops)?\s*", value)
    if not m:
        raise InputError(f"{what}: cannot read {value!r} as compute (e.g. 28 TFLOPS)")
    return float(m.group(1)) * _SI[m.group(2)]


def _plain(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{what}: expected a number or a string with units, got {value!r}")
    return value


def _field(entry: dict, where: str, long: str, short: str, parse, default: Any = None) -> Any:
    if long == short:
        if long in entry:
            return parse(entry[long], f"{where}.{long}")
    elif long in entry and short in entry:
        raise InputError(f"{where}: give {long!r} or {short!r}, not both")
    if long in entry:
        return _plain(entry[long], f"{where}.{long}")
    if short in entry:
        return parse(entry[short], f"{where}.{short}")
    if default is not None:
        return default
    raise InputError(f"{where}: missing {long!r} (or {short!r} with units)")


def read_cluster(path: str | Path) -> tuple[list[NodeSpec], list[LinkSpec], dict]:
    """Parse a nodes file into (nodes, links, policy overrides). Raises InputError."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"{p}: no such nodes file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}: not valid JSON ({exc})") from None
    if isinstance(data, list):
        data = {"nodes": data}
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise InputError(f"{p}: expected an object with a 'nodes' list")
    nodes = []
    for i, e in enumerate(data["nodes"]):
        where = f"{p.name}: nodes[{i}]"
        if not isinstance(e, dict):
            raise InputError(f"{where}: expected an object")
        _no_unknown(e, where, {"node_id", "memory_bytes", "memory", "bandwidth_bytes_per_s", "bandwidth", "flops",
                               "name", "chip", "comment"})
        try:
            nodes.append(
                NodeSpec(
                    node_id=e.get("node_id"),
                    memory_bytes=_field(e, where, "memory_bytes", "memory", parse_bytes),
                    bandwidth_bytes_per_s=_field(e, where, "bandwidth_bytes_per_s", "bandwidth", parse_bandwidth),
                    flops=_field(e, where, "flops", "flops", parse_flops),
                )
            )
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from None
    links = []
    raw_links = data.get("links", [])
    if not isinstance(raw_links, list):
        raise InputError(f"{p}: 'links' must be a list")
    for i, e in enumerate(raw_links):
        where = f"{p.name}: links[{i}]"
        if not isinstance(e, dict):
            raise InputError(f"{where}: expected an object")
        _no_unknown(e, where, {"a", "b", "bandwidth_bytes_per_s", "bandwidth", "latency_s", "latency", "kind",
                               "comment"})
        try:
            links.append(
                LinkSpec(
                    a=e.get("a"),
                    b=e.get("b"),
                    bandwidth_bytes_per_s=_field(e, where, "bandwidth_bytes_per_s", "bandwidth", parse_bandwidth),
                    latency_s=_field(e, where, "latency_s", "latency", parse_seconds),
                    kind=e.get("kind", "direct"),
                )
            )
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from None
    policy = data.get("policy", {})
    if not isinstance(policy, dict):
        raise InputError(f"{p}: 'policy' must be an object")
    overrides: dict[str, Any] = {}
    for key, value in policy.items():
        where = f"{p.name}: policy.{key}"
        if key == "fallback_bandwidth":
            overrides["fallback_bandwidth_bytes_per_s"] = parse_bandwidth(value, where)
        elif key == "fallback_latency":
            overrides["fallback_latency_s"] = parse_seconds(value, where)
        else:
            overrides[key] = value
    return nodes, links, overrides


def _no_unknown(entry: dict, where: str, allowed: set[str]) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r}")


def _hub_model_spec(model: str, context: int | None, name: str | None):
    """The spec of a Hub model, built as the daemon builds it (whole model, lazily, from its
    headers; :func:`ringlet.daemon.engine.stage.build_lazy_model`)."""
    from ringlet.daemon.engine.hub import locate
    from ringlet.daemon.engine.model_config import text_config
    from ringlet.daemon.engine.modelspec import model_spec_from_model
    from ringlet.daemon.engine.stage import build_lazy_model
    from ringlet.daemon.errors import RingletError

    try:
        location = locate(model)
        lazy, config = build_lazy_model(location)
    except RingletError as exc:
        raise InputError(f"--model: {exc}") from None
    ctx = context if context is not None else int(text_config(config).get("max_position_embeddings") or 4096)
    return model_spec_from_model(lazy, context_tokens=ctx, name=name or location.name, config=config)


def _model_contexts(args: argparse.Namespace) -> dict[str, int]:
    """``--model-context`` by ``--model`` value (:func:`~.lanes_run.parse_model_contexts`).

    Raises:
        InputError: a malformed value or a model not given.
    """
    from ringlet.daemon.errors import RingletError
    from ringlet.daemon.ops.lanes_run import parse_model_contexts

    try:
        return parse_model_contexts(getattr(args, "model_context", None), args.model)
    except RingletError as exc:
        raise InputError(str(exc)) from None


def _model_spec(model: str, context: int | None, name: str | None):
    from ringlet.daemon.engine.hub import parse_ref
    from ringlet.daemon.engine.model_config import ModelSpecError
    from ringlet.daemon.engine.modelspec import model_spec_from_config

    source: Any = model
    if parse_ref(model) is not None:  # a Hub name: its config and safetensors headers, no weights
        return _hub_model_spec(model, context, name)
    if model.lstrip().startswith("{"):
        try:
            source = json.loads(model)
        except json.JSONDecodeError as exc:
            raise InputError(f"--model: inline JSON is invalid ({exc})") from None
    elif model.endswith(".gguf"):
        raise InputError(f"--model {model}: GGUF files are planned by the daemon once loaded; give a config.json")
    try:
        return model_spec_from_config(source, context_tokens=context, name=name)
    except ModelSpecError as exc:
        raise InputError(f"--model: {exc}") from None


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", required=True, help="JSON file with nodes, links and optional policy settings")
    p.add_argument("--model", required=True, action="append",
                   help="config.json, a model directory, inline JSON config, or a Hub name ORG/NAME[@REVISION] "
                        "(its config and safetensors headers are read; no weights); repeat it to place several "
                        "models together, highest priority first")
    p.add_argument("--policy", choices=POLICY_NAMES, default=None, help="planning policy (default: balanced)")
    p.add_argument("--context", type=int, default=None,
                   help="KV-cache length in tokens to plan for (default: the model's max_position_embeddings)")
    p.add_argument("--model-context", action="append", default=None, metavar="MODEL=TOKENS",
                   help="one model's KV-cache length (MODEL: a --model value or its short key; repeatable; "
                        "the others take --context), as ringlet run takes it")
    p.add_argument("--tolerance", type=float, default=None,
                   help="with --previous: accept plans this fraction worse to move fewer bytes (default 0.01)")
    p.add_argument("--prefill-share", type=float, default=None,
                   help="balanced: how much of the stages' time is prefill rather than decode, 0..1 "
                        f"(default {DEFAULT_PREFILL_SHARE}, as ringlet run)")
    p.add_argument("--previous", default=None,
                   help="the current plan (JSON from --json; with several --model, the placement) to re-shard from")
    p.add_argument("--name", default=None, action="append",
                   help="model name recorded in the plan (default: directory name); one per --model")
    p.add_argument("--model-overhead", default=None,
                   help="memory each model's process takes on every node it runs on beyond its stage "
                        "(e.g. 2 GiB; default 0)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``argparse`` subparsers object; returns the new parser."""
    p = subparsers.add_parser(
        "plan",
        help="plan a ring for a model on a set of nodes (no daemon needed)",
        description="Choose the ring order and layer ranges for a model on the nodes in a JSON file.",
    )
    _add_arguments(p)
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """Run ``ringlet plan``; returns the exit status (0 ok, 1 does not fit, 2 bad input)."""
    try:
        return _run(args)
    except InputError as exc:
        _err(str(exc))
        return EXIT_BAD_INPUT
    except (ValueError, TypeError) as exc:
        _err(str(exc))
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - the CLI contract: one line, never a traceback
        _err(f"unexpected {type(exc).__name__}: {exc}")
        return EXIT_BAD_INPUT


def _err(msg: str) -> None:
    print(f"ringlet plan: error: {' '.join(msg.split())}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    if args.context is not None and args.context < 0:
        raise InputError("--context must be >= 0")
    nodes, links, overrides = read_cluster(args.nodes)
    if args.policy is not None:
        overrides["name"] = args.policy
    if args.tolerance is not None:
        overrides["tolerance"] = args.tolerance
    overrides.setdefault("prefill_share", DEFAULT_PREFILL_SHARE if args.prefill_share is None else args.prefill_share)
    try:
        policy = Policy(**overrides)
    except TypeError as exc:
        raise InputError(f"{args.nodes}: policy: {exc}") from None
    previous = None
    if args.previous and len(args.model) == 1:
        try:
            previous = Plan.from_json(Path(args.previous).expanduser().read_text())
        except OSError as exc:
            raise InputError(f"--previous: cannot read ({exc})") from None
        except ValueError as exc:
            raise InputError(f"--previous: {exc}") from None
    names = args.name or [None] * len(args.model)
    if len(names) != len(args.model):
        raise InputError(f"give one --name per --model ({len(names)} names, {len(args.model)} models)")
    overhead = int(parse_bytes(args.model_overhead, "--model-overhead")) if args.model_overhead else 0
    contexts = _model_contexts(args)
    if len(args.model) > 1:
        specs = [_model_spec(m, contexts.get(m, args.context), n) for m, n in zip(args.model, names, strict=True)]
        return _run_models(args, nodes, links, specs, policy, overhead)
    if overhead:
        nodes = [replace(n, memory_bytes=max(0, n.memory_bytes - overhead)) for n in nodes]
    model = _model_spec(args.model[0], contexts.get(args.model[0], args.context), names[0])
    try:
        plan = make_plan(nodes, links, model, previous=previous, policy=policy)
    except Infeasible as exc:
        if args.json:
            print(json.dumps(exc.to_dict(), indent=2))
        _err(str(exc))
        return EXIT_INFEASIBLE
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print_plan(plan, model)
    return EXIT_OK


def _run_models(args: argparse.Namespace, nodes, links, models, policy: Policy, overhead: int) -> int:
    """Several ``--model``: place them together (:mod:`.plan_models`); 0 when every model is
    placed, 1 when one is left out (each reason also on stderr with ``--json``)."""
    if len({m.name for m in models}) != len(models):
        raise InputError("two models have the same name: give each its own --name")
    previous = read_previous(args.previous) if args.previous else None
    placement = place_models(nodes, links, models, previous=previous, policy=policy,
                             per_model_overhead_bytes=overhead)
    if args.json:
        print(json.dumps(placement.to_dict(), indent=2))
        for reason in placement.left_out.values():
            _err(f"left out: {reason}")
    else:
        print_placement(placement, print_plan)
    return EXIT_INFEASIBLE if placement.left_out else EXIT_OK


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{int(n)} B"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s >= 1e-4 else f"{s * 1e6:,.1f} µs"


def print_plan(plan: Plan, model=None, console=None) -> None:
    """Render ``plan`` as rich tables (stages, hops, left-out nodes, summary)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=120)
    title = f"ringlet plan · {plan.model_name} · {plan.num_layers} layers · context {plan.context_tokens:,} tokens"
    t = Table(title=title, title_justify="left")
    for col, just in (("#", "right"), ("node", "left"), ("layers", "left"), ("n", "right"), ("memory", "right"),
                      ("of", "right"), ("time/token", "right"), ("load", "right"), ("holds", "left")):
        t.add_column(col, justify=just)
    for i, s in enumerate(plan.stages):
        holds = ", ".join(x for x, on in (("embedding", s.embeds), ("head", s.heads)) if on)
        t.add_row(str(i), s.node_id, f"[{s.start}, {s.end})", str(s.num_layers), _gb(s.memory_bytes),
                  f"{s.memory_bytes / s.capacity_bytes:.0%}", _ms(s.time_s), _gb(s.load_bytes), holds)
    console.print(t)
    if plan.hops:
        h = Table(title="hops", title_justify="left")
        for col in ("from", "to", "kind", "path", "bandwidth", "time/token"):
            h.add_column(col)
        for hop in plan.hops:
            h.add_row(hop.src, hop.dst, hop.kind + (" (return)" if hop.returns else ""), " → ".join(hop.path),
                      f"{hop.bandwidth_bytes_per_s * 8 / 1e9:,.1f} Gb/s", _ms(hop.time_s))
        console.print(h)
    if plan.excluded:
        x = Table(title="left out", title_justify="left")
        x.add_column("node")
        x.add_column("why")
        for e in plan.excluded:
            x.add_row(e.node_id, e.reason)
        console.print(x)
    tps = plan.throughput_tokens_per_s
    ring = " → ".join(plan.ring_order + plan.ring_order[:1]) if len(plan.stages) > 1 else f"{plan.ring_order[0]} alone"
    console.print(f"policy [bold]{plan.policy}[/bold] · ring {ring}")
    one = f" ({1 / plan.latency_s:,.1f} tokens/s)" if plan.latency_s > 0 else ""
    console.print(
        f"per token: slowest stage {_ms(plan.max_stage_time_s)}, one request {_ms(plan.latency_s)}{one}"
        + (f", pipeline bound {tps:,.1f} tokens/s" if tps else "")
    )
    console.print(f"load {_gb(plan.load_bytes)} · plan id {plan.plan_id}")
    for note in plan.notes:
        console.print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    """``python -m ringlet.daemon.ops.plan`` -- the same as ``ringlet plan``."""
    parser = argparse.ArgumentParser(prog="ringlet plan", description=add_plan_parser.__doc__)
    _add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed a usage line
        return int(exc.code or 0)
    return run_plan(args)


if __name__ == "__main__":
    sys.exit(main())


# --- the ``ringlet`` CLI extension protocol (see daemon/ops/cli.py) ---------------------------
COMMANDS = frozenset({"plan"})


def add_parsers(subparsers) -> None:
    """Register ``ringlet plan``."""
    add_plan_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    """Run ``ringlet plan``."""
    return run_plan(args)
