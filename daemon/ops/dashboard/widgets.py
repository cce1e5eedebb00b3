"""The pieces a dashboard frame is drawn from, as rich ``Text``: a stage's layer range
against the model's depth, memory used/total as a bar, its state (with a bar while
loading) and the hop to the next stage. A value not reported is drawn as "—"."""

from __future__ import annotations

from rich.text import Text

from ringlet.daemon.ops.format import DASH, fmt_bandwidth, fmt_bytes, fmt_pair, fmt_seconds

STAGE_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
STATE_STYLES = {
    "serving": "bold green", "ready": "green", "loading": "yellow", "fetching": "yellow", "starting": "yellow",
    "discovering": "cyan", "negotiating": "cyan", "suspect": "bold red", "unreachable": "bold red",
    "left": "red", "gone": "red", "stopped": "dim", "leaving": "yellow", "unplanned": "yellow",
    "standby": "cyan", "alive": "green", "no-address": "yellow",
    # a model's lane (several models per node)
    "planning": "cyan", "left out": "bold yellow", "restarting": "bold red", "stopping": "yellow",
    "failed": "bold red",
}
LINK_SHORT = {"thunderbolt": "TB", "ethernet": "eth", "loopback": "lo", "wifi": "wifi"}


def layer_bar(r: list[int] | None, depth: int | None, width: int, color: str) -> Text:
    """The range ``[start, end)`` drawn against ``depth`` layers, ``width`` cells wide.

    Cell ``i`` stands for layers ``[i*depth/width, (i+1)*depth/width)``; boundaries are
    rounded so that consecutive stages tile the bar exactly.
    """
    width = max(1, width)
    if not r or not depth or depth <= 0:
        return Text("·" * width, style="dim")
    def cell(layer: int) -> int:  # round half up, in integers: boundaries never drift
        return (2 * max(0, min(layer, depth)) * width + depth) // (2 * depth)

    a, b = cell(r[0]), cell(r[1])
    if r[1] > r[0] and b == a:
        b = min(width, a + 1)
        a = b - 1
    t = Text()
    t.append("─" * a, style="dim")
    t.append("━" * (b - a), style=f"bold {color}")
    t.append("─" * (width - b), style="dim")
    return t


def memory_bar(used: float | None, total: float | None, width: int) -> Text:
    """``████░░░░`` for used/total; empty when the total is unknown."""
    if not total or used is None:
        return Text(" " * width)
    frac = max(0.0, min(1.0, used / total))
    filled = round(frac * width)
    style = "green" if frac < 0.7 else "yellow" if frac < 0.9 else "bold red"
    t = Text("█" * filled, style=style)
    t.append("░" * (width - filled), style="dim")
    return t


def memory_text(used: float | None, total: float | None, bar_width: int) -> Text:
    """``████░░░░ 62/192 GiB``, or ``287 MiB used`` when the total is unknown."""
    if not total:
        return Text(f"{fmt_bytes(used)} used" if used is not None else DASH, style="dim" if used is None else "")
    t = memory_bar(used, total, bar_width)
    t.append(" " + fmt_pair(used, total))
    return t


def progress_of(node: dict) -> float | None:
    """A snapshot node's progress: its stage load's, else its download's (0..1)."""
    if node.get("loading_progress") is not None:
        return node["loading_progress"]
    return (node.get("download") or {}).get("fraction")


def state_text(state: str | None, progress: float | None, width: int = 0) -> Text:
    """``serving`` / ``loading 45% ██░░`` / ``fetching 10% █░░░`` / ``—``, coloured."""
    if not state:
        return Text(DASH, style="dim")
    style = STATE_STYLES.get(state, "")
    if state in ("loading", "fetching") and progress is not None:
        t = Text(f"{state} {progress:.0%}", style=style)
        room = width - len(t) - 1
        if room >= 4:
            filled = round(progress * room)
            t.append(" " + "█" * filled, style="yellow")
            t.append("░" * (room - filled), style="dim")
        return t
    return Text(state, style=style)


def hop_text(hop: dict | None, short: bool) -> Text:
    """The arrow to the next stage with what is known of the link."""
    if hop is None:
        return Text("")
    arrow = "↩ " if hop["returns"] else "▼ "
    parts = []
    kind = hop.get("kind")
    if kind:
        parts.append(LINK_SHORT.get(kind.lower(), kind) if short else kind)
    if hop.get("bandwidth_bytes_per_s") is not None:
        parts.append(fmt_bandwidth(hop["bandwidth_bytes_per_s"]))
    if hop.get("rtt_s") is not None:
        parts.append(("" if short else "RTT ") + fmt_seconds(hop["rtt_s"]))
    elif hop.get("hop_latency_s") is not None:
        parts.append("hop " + fmt_seconds(hop["hop_latency_s"]))
    t = Text(arrow, style="bold")
    if hop["returns"]:
        t.append(f"{hop['to_name']}" + (" · " if parts else ""), style="dim")
    t.append((" " if short else " · ").join(parts) if parts else ("" if hop["returns"] else DASH),
             style="bright_blue")
    return t


def chip_label(node: dict) -> str:
    """A node's chip and release, e.g. ``Apple M3 Ultra · 0.2.0`` (``—`` for what is unknown)."""
    release = node.get("release")
    return f"{node.get('chip') or DASH}" + (f" · {release}" if release else "")
