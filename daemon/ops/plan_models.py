"""``ringlet plan`` with several ``--model``: the models placed together in pooled memory.

    ringlet plan --nodes nodes.json --model BIG --model MEDIUM --model SMALL [--context N]
                 [--name A --name B --name C] [--model-overhead 2GiB] [--previous placement.json] [--json]

The models are given highest priority first; :func:`ringlet.partitioning.place_models`
plans each on the memory the ones before it leave (issue #45). The output is each
placed model's plan in ``ringlet plan``'s format under a heading with its priority and
name, then the models left out with the reason, then every node's memory: the pool,
what each model uses there (its stage and the overhead) and what is left. ``--json``
prints ``Placement.to_dict()``; ``--previous`` takes that JSON back (or one model's plan).
Exit status: 0 every model placed, 1 some model left out, 2 bad input.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ringlet.partitioning import Placement, Plan


def read_previous(path: str) -> dict[str, Plan]:
    """Model name -> previous plan, from ``--json`` output: a placement, or one model's plan.

    Raises:
        ValueError: an unreadable file or content that is neither (the message names ``--previous``).
    """
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ValueError(f"--previous: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--previous: not valid JSON ({exc})") from None
    try:
        if isinstance(data, dict) and "plans" in data:
            return Placement.from_dict(data).plans
        plan = Plan.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"--previous: {exc}") from None
    return {plan.model_name: plan}


def print_placement(placement: Placement, print_plan: Callable, console=None) -> None:
    """Render ``placement``: each placed model's plan under its heading (drawn by
    ``print_plan(plan, console=...)``, ``ringlet plan``'s single-model format), the models
    left out with the reason, and the memory per node."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=120)
    n = len(placement.priority)
    console.print(f"ringlet plan · {n} models in pooled memory · priority {', '.join(placement.priority)}")
    for rank, name in enumerate(placement.priority, 1):
        plan = placement.plans.get(name)
        console.print()
        console.rule(f"[bold]priority {rank} of {n} · {name}[/bold]", align="left")
        if plan is None:
            console.print("left out: answered with 503 (the reason is under 'left out' below)")
            continue
        if rank > 1:
            console.print("planned on the memory the models before it leave (the 'of' column is a share of that)")
        print_plan(plan, console=console)
    console.print()
    if placement.left_out:
        x = Table(title="left out (answered with 503)", title_justify="left")
        x.add_column("priority", justify="right")
        x.add_column("model")
        x.add_column("why")
        for name, reason in placement.left_out.items():
            x.add_row(str(placement.priority.index(name) + 1), name, reason)
        console.print(x)
    t = Table(title="memory per node", title_justify="left")
    t.add_column("node")
    t.add_column("memory", justify="right")
    used = {name: placement.used_bytes(name) for name in placement.plans}
    for name in used:
        t.add_column(f"{placement.priority.index(name) + 1} · {name}", justify="right")
    t.add_column("left", justify="right")
    for node_id, memory in placement.memory_bytes.items():
        cells = [_gb(u[node_id]) if node_id in u else "-" for u in used.values()]
        t.add_row(node_id, _gb(memory), *cells, _gb(placement.memory_left[node_id]))
    console.print(t)
    if placement.overhead_bytes:
        console.print(f"each model's column: its stage and {_gb(placement.overhead_bytes)} of overhead")


def _gb(n: float) -> str:
    """Decimal units, as ``ringlet plan`` prints a plan's memory."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{int(n)} B"
