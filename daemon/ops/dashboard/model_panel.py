"""The dashboard's models panel: a node serving several models (issue #45) shows one line
per model, in priority order -- its name (and aliases), its state, its ring (the stages'
machines and layer ranges) or why it is left out, and what it holds of what it is offered
on the node asked (the snapshot's ``models``, :mod:`ringlet.daemon.ops.status.model_rings`)."""

from __future__ import annotations

from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from ringlet.daemon.ops.dashboard.widgets import STAGE_COLORS, state_text
from ringlet.daemon.ops.format import DASH, fmt_bytes, fmt_pair
from ringlet.daemon.ops.status.model_rings import why_text

__all__ = ["models_panel", "models_rule"]


def models_rule(models: list[dict]) -> Rule:
    node = next((m["node"] for m in models if m.get("node")), None)
    title = f"models: {len(models)}, priority order · each its own ring" + (
        f" · held/offered on {node}" if node else "")
    return Rule(Text(title, overflow="ellipsis", no_wrap=True), align="left", style="dim")


def _ring(model: dict) -> Text:
    if not model.get("stages"):
        why = why_text(model)  # left out, or its process cannot start
        return Text(why, style="yellow") if why else Text("no plan yet", style="dim")
    t = Text()
    for i, s in enumerate(model["stages"]):
        if i:
            t.append(" → ", style="dim")
        t.append(s["name"], style="bold")
        if s.get("layer_range"):
            a, b = s["layer_range"]
            t.append(f" [{a},{b})", style=STAGE_COLORS[i % len(STAGE_COLORS)])
    return t


def _memory(model: dict) -> str:
    held, share = model.get("footprint_bytes"), model.get("share_bytes")
    if share is None:
        text = f"{fmt_bytes(held)}/all" if model.get("priority") == 0 else fmt_bytes(held)
    else:
        text = fmt_pair(held, share)
    return text.replace(" ", "") if held is not None else DASH


def models_panel(models: list[dict], width: int) -> Table:
    """One line per model: priority, name (aliases), state, ring or why left out, held/offered."""
    names = [m["name"] + (f" ({', '.join(m['aliases'])})" if m.get("aliases") else "") for m in models]
    mems = [_memory(m) for m in models]
    name_w = max(8, min(max(len(n) for n in names), 28 if width >= 120 else 18))
    mem_w = max(len(m) for m in mems)
    state_w = max(7, *(len(m.get("state") or DASH) for m in models))
    t = Table.grid(padding=(0, 1), expand=True)
    t.add_column(width=2, justify="right", no_wrap=True)
    t.add_column(width=name_w, no_wrap=True, overflow="ellipsis")
    t.add_column(width=state_w, no_wrap=True, overflow="ellipsis")
    t.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
    t.add_column(width=mem_w, justify="right", no_wrap=True)
    for m, name, mem in zip(models, names, mems, strict=True):
        flight = m.get("requests_in_flight")
        ring = _ring(m)
        if flight:
            ring = Text.assemble(ring, (f" · {flight} in flight", "bold"))
        t.add_row(Text(str(m["priority"] + 1), style="bold"), Text(name, style="bold cyan"),
                  state_text(m.get("state"), None, state_w), ring, Text(mem, style="dim" if mem == DASH else ""))
    return t
