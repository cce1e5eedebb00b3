"""``ringlet dashboard``: a live terminal view of the cluster (rich).

What it draws, from a snapshot (:mod:`ringlet.daemon.ops.status`):

- a header: model, depth, plan epoch, policy, mode, negotiation, how many stages
  are ready, requests in flight and the ring's tokens/s, and the time;
- **the ring**: the stages in plan order, one per row, each with its name, chip,
  state (``loading 45%`` with a bar while loading), memory used/total as a bar, its
  layer range drawn against the model's depth, tokens/s, its decode batch (mean
  over the last 10 s / limit, ``2.4/8``) and the hop to the next stage (link kind,
  bandwidth, RTT; the last row's hop returns to stage 0);
- **the cluster**: total / usable / used memory and the last requests with their
  TTFT and tokens/s;
- **an event log**: the daemon's events (joins, leaves, re-plans, errors) plus
  what the dashboard itself saw change between snapshots.

Anything a daemon does not report is drawn as "—". :func:`render` is pure (a
snapshot in, a rich renderable out) and lays the frame out for the width it is
given: two lines per stage below 120 columns (readable at 80x24), one wide line
per stage from 120 columns on. The live loop polls at 2 Hz and redraws in place
(``rich.live.Live`` with ``auto_refresh=False``; no clearing, hence no flicker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from ringlet.daemon.ops.format import (
    DASH,
    fmt_bandwidth,
    fmt_batch,
    fmt_bytes,
    fmt_pair,
    fmt_range,
    fmt_rate,
    fmt_seconds,
    fmt_ts,
    main_word,
    mode_text,
    policy_text,
    ts_key,
)
from ringlet.daemon.ops.status import Collector, normalize_api_url

log = logging.getLogger(__name__)

#: Layout switch: one line per stage from this width on.
WIDE = 120
#: Poll and redraw period of the live view, seconds (2 Hz).
DEFAULT_INTERVAL_S = 0.5
STAGE_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
STATE_STYLES = {
    "serving": "bold green", "ready": "green", "loading": "yellow", "starting": "yellow",
    "discovering": "cyan", "negotiating": "cyan", "suspect": "bold red", "unreachable": "bold red",
    "left": "red", "gone": "red", "stopped": "dim", "leaving": "yellow", "unplanned": "yellow",
    "standby": "cyan", "alive": "green",
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


def state_text(state: str | None, progress: float | None, width: int = 0) -> Text:
    """``serving`` / ``loading 45% ██░░`` / ``—``, coloured."""
    if not state:
        return Text(DASH, style="dim")
    style = STATE_STYLES.get(state, "")
    if state == "loading" and progress is not None:
        t = Text(f"loading {progress:.0%}", style=style)
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


# --------------------------------------------------------------------------- the frame


def render(snapshot: dict, *, height: int | None = None, last_good: dict | None = None,
           live: bool = False) -> Dashboard:
    """A rich renderable for ``snapshot`` (pure).

    Args:
        snapshot: from :func:`ringlet.daemon.ops.status.build_snapshot`.
        height: lines available (a live terminal); ``None`` = as many as needed.
        last_good: the last snapshot that reached the cluster, drawn (with a banner)
            when ``snapshot`` did not.
        live: the frame is one of a live view (which retries when the cluster is out of reach).
    """
    return Dashboard(snapshot, height=height, last_good=last_good, live=live)


class Dashboard:
    """One frame; lays itself out for the console width it is rendered at."""

    def __init__(self, snapshot: dict, height: int | None = None, last_good: dict | None = None,
                 live: bool = False):
        self.snapshot = snapshot
        self.height = height
        self.last_good = last_good
        self.live = live

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        snap = self.snapshot
        banner = None
        if not snap.get("reachable"):
            banner = Text(f"✖ cannot reach the cluster: {snap.get('error') or 'no answer'}"
                          + (" — retrying" if self.live else ""), style="bold red")
            if self.last_good is None:
                yield Text.assemble(("ringlet ", "bold"), (time.strftime("%H:%M:%S", time.localtime(
                    snap.get("taken_at") or time.time())), "dim"))
                yield banner
                yield from self._events(snap.get("events", []), None if self.height is None else self.height - 2)
                return
            snap = dict(self.last_good, events=snap.get("events") or self.last_good.get("events", []))
        height = self.height
        wide = width >= WIDE
        out: list = []
        out += self._header(snap, width, wide)
        if banner is not None:
            out.append(banner)
        elif snap.get("error"):
            out.append(Text(f"not reached: {snap['error']}", style="yellow", overflow="ellipsis", no_wrap=True))
        nodes = snap.get("nodes", [])
        used = len(out)
        dense = not wide and height is not None and used + 1 + 2 * len(nodes) + 7 > height
        out.append(self._ring_rule(snap))
        out.append(self._ring(snap, width, wide, dense))
        used += 1 + (len(nodes) if (wide or dense) else 2 * len(nodes)) + (1 if wide else 0)
        cluster = self._cluster_line(snap)
        recent = snap.get("recent_requests", [])
        events = snap.get("events", [])
        if height is None:
            n_recent, n_events = min(len(recent), 5), min(len(events), 8)
        else:
            # lines besides the request rows and event rows: compact = cluster rule + line,
            # requests rule + header, events rule; wide = the rules row, the requests header
            # (the cluster line sits beside it), events rule
            avail = height - used - (3 if wide else 5)
            if avail < 1:
                yield from out
                return
            n_recent = min(len(recent) or 1, max(1, avail // 3), 5)
            n_events = max(0, avail - n_recent)
        requests = self._requests(recent, n_recent)
        if wide:
            grid = Table.grid(expand=True, padding=(0, 2))
            grid.add_column(ratio=2)
            grid.add_column(ratio=3)
            grid.add_row(Group(Rule("cluster", align="left", style="dim"), cluster),
                         Group(Rule(self._requests_title(snap), align="left", style="dim"), requests))
            out.append(grid)
        else:
            out.append(Rule("cluster", align="left", style="dim"))
            out.append(cluster)
            out.append(Rule(self._requests_title(snap), align="left", style="dim"))
            out.append(requests)
        yield from out
        if n_events or height is None:
            yield from self._events(events, n_events + 1 if height is not None else None, limit=n_events)

    # -- pieces

    def _header(self, snap: dict, width: int, wide: bool) -> list:
        c = snap.get("cluster", {})
        clock = time.strftime("%H:%M:%S", time.localtime(snap.get("taken_at") or time.time()))
        layers = f"{c['num_layers']} layers" if c.get("num_layers") is not None else f"{DASH} layers"
        epoch = f"epoch {c['epoch']}" if c.get("epoch") is not None else f"epoch {DASH}"
        left = Text.assemble(("ringlet ", "bold"), (c.get("model") or DASH, "bold cyan"), f" · {layers} · ",
                             (epoch, "bold"))
        ready = f"{c.get('nodes_ready', 0)}/{c.get('nodes', 0)} ready"
        flight = c.get("requests_in_flight")
        status = Text.assemble(
            (ready, "green" if c.get("nodes") and c.get("nodes_ready") == c.get("nodes") else "yellow"),
            f" · in flight {DASH if flight is None else flight} · ",
            (f"{fmt_rate(c.get('tokens_per_s'))} tok/s", "bold"),
        )
        second = Text(f"policy {policy_text(c.get('policy'))} · mode {mode_text(c)} · "
                      f"negotiation {main_word(c.get('negotiation'))}", style="dim")
        def line(a: Text, b: Text) -> Table:
            grid = Table.grid(expand=True, padding=(0, 0, 0, 1))
            grid.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
            grid.add_column(justify="right", no_wrap=True, min_width=min(len(b), max(8, width - 20)))
            grid.add_row(a, b)
            return grid

        if wide:
            left.append(" · ")
            left.append_text(second)
            return [line(left, Text.assemble(status, "  ", (clock, "dim")))]
        return [line(left, Text(clock, style="dim")), line(second, status)]

    def _ring_rule(self, snap: dict) -> Rule:
        names = [n["name"] for n in snap.get("nodes", []) if n.get("in_plan")]
        c = snap.get("cluster", {})
        if c.get("groups"):
            by_id = {n["node_id"]: n["name"] for n in snap.get("nodes", [])}
            state = f" ({c['tensor_group']})" if c.get("tensor_group") else ""
            chain = " → ".join(f"{fmt_range(g.get('layers'))} " + " ↔ ".join(by_id.get(r, r[:8]) for r in g["ranks"])
                               for g in c["groups"])
            title = f"hybrid{state}: {chain}"
            return Rule(Text(title, overflow="ellipsis", no_wrap=True), align="left", style="dim")
        if c.get("ranks"):
            by_id = {n["node_id"]: n["name"] for n in snap.get("nodes", [])}
            ranks = " ↔ ".join(f"{i}:{by_id.get(r, r[:8])}" for i, r in enumerate(c["ranks"]))
            state = f", {c['tensor_group']}" if c.get("tensor_group") else ""
            title = f"tensor group ({c.get('backend') or DASH}{state}): {ranks}"
            return Rule(Text(title, overflow="ellipsis", no_wrap=True), align="left", style="dim")
        if len(names) > 1:
            title = "ring: " + " → ".join(names + names[:1])
        elif names:
            title = f"ring: {names[0]} alone"
        else:
            title = "ring: no plan"
        return Rule(Text(title, overflow="ellipsis", no_wrap=True), align="left", style="dim")

    def _ring(self, snap: dict, width: int, wide: bool, dense: bool) -> Table:
        c = snap.get("cluster", {})
        depth = c.get("num_layers")
        nodes = snap.get("nodes", [])
        hops = {h["from"]: h for h in snap.get("hops", [])}
        t = Table(box=None, show_header=wide, padding=(0, 1, 0, 0), pad_edge=False, expand=False,
                  header_style="dim")
        batches = {n["address"]: fmt_batch(n.get("batch_mean"), n.get("max_batch")) for n in nodes}
        batch_w = max([1] + [len(b) for b in batches.values()])
        if wide:
            batch_w = max(len("batch"), batch_w)
            name_w = max(8, min(24, max((len(n["name"]) for n in nodes), default=12)))
            chip_w = max(4, min(16, max((len(n["chip"] or DASH) for n in nodes), default=4)))
            # columns and their padding, layer bar and memory excluded
            fixed = 2 + name_w + chip_w + 17 + 9 + 7 + batch_w + 8
            # the hop column as wide as its longest label -- long form when the layer bar keeps
            # 20 cells, else the short form -- and the layer bar gets the rest; the memory bar
            # gives up 5 of its 10 cells before the hop labels go short
            long_need, short_need = (
                max([len("hop to next stage")] + [len(hop_text(hops.get(n["address"]), short=f)) for n in nodes])
                for f in (False, True))
            choices = ((False, long_need, 10, 20), (False, long_need, 5, 20),
                       (True, short_need, 10, 16), (True, short_need, 5, 16))
            short, need, mem_bar, _ = next(
                (ch for ch in choices if width - fixed - (ch[2] + 13) - ch[1] >= ch[3]),
                (True, max(20, width - fixed - 18 - 12), 5, 0))
            others = fixed + mem_bar + 13
            avail = width - others
            bar_w = max(12, min(40, avail - need))
            hop_w = max(12, width - others - bar_w)
            for name, w, just in (("#", 2, "right"), ("node", name_w, "left"), ("chip", chip_w, "left"),
                                  ("state", 17, "left"), ("layers", 9 + bar_w, "left"),
                                  ("memory", mem_bar + 13, "left"), ("tok/s", 7, "right"),
                                  ("batch", batch_w, "right"), ("hop to next stage", hop_w, "left")):
                t.add_column(name, width=w, justify=just, no_wrap=True, overflow="ellipsis")
        else:
            # two lines per stage: the batch ("batch 2.4/8") under the tokens/s; one line
            # (dense): the batch in a column of its own, taken from the layer bar
            short = True
            batch_w += len("batch ")
            tps_w = max(10, batch_w) if not dense else 10
            state_w = 17
            name_w = max(10, min(28, 16 + (width - 80) // 3))
            if dense:
                name_w = max(10, min(name_w, max((len(n["name"]) for n in nodes), default=10)))
            cols = [(2, "right"), (name_w, "left"), (state_w, "left"), (0, "left"), (tps_w, "right")]
            if dense:
                cols.append((batch_w, "right"))
            layers_w = max(14, width - sum(w for w, _ in cols) - (len(cols) - 1))
            cols[3] = (layers_w, "left")
            bar_w = max(4, layers_w - 9)
            for w, just in cols:
                t.add_column(width=w, justify=just, no_wrap=True, overflow="ellipsis")
        for n in nodes:
            idx = Text(DASH if n["stage"] is None else str(n["stage"]), style="bold" if n["in_plan"] else "dim")
            color = STAGE_COLORS[(n["stage"] or 0) % len(STAGE_COLORS)] if n["in_plan"] else "white"
            rng = Text(f"{fmt_range(n['layer_range']):<8} ", style=color if n["in_plan"] else "dim")
            stale = c.get("epoch") is not None and n.get("epoch") is not None and n["epoch"] != c["epoch"]
            if stale:
                rng = Text(f"e{n['epoch']} {fmt_range(n['layer_range'])} ", style="yellow")
            hop = hops.get(n["address"])
            hop_t = hop_text(hop, short=short) if n["in_plan"] else Text("not in plan", style="dim")
            tps = Text(fmt_rate(n["tokens_per_s"]) + ("" if wide else " tok/s"),
                       style="bold" if n["tokens_per_s"] else "dim")
            name = Text(n["name"], style="bold" if n["in_plan"] else "dim")
            batch = batches[n["address"]]
            batch_t = Text(batch if wide else f"batch {batch}", style="dim" if batch == DASH else "")
            if wide:
                mem = memory_text(n["memory_used_bytes"], n["memory_total_bytes"], mem_bar)
                t.add_row(idx, name, Text(n["chip"] or DASH), state_text(n["state"], n["loading_progress"], 17),
                          rng + layer_bar(n["layer_range"], depth, bar_w, color), mem, tps, batch_t, hop_t)
            elif dense:
                t.add_row(idx, name, state_text(n["state"], n["loading_progress"], state_w),
                          rng + layer_bar(n["layer_range"], depth, bar_w, color), tps, batch_t)
            else:
                mem = memory_text(n["memory_used_bytes"], n["memory_total_bytes"], 5)
                line2_name = Text(n["chip"] or DASH, style="dim")
                t.add_row(idx, name, state_text(n["state"], n["loading_progress"], state_w),
                          rng + layer_bar(n["layer_range"], depth, bar_w, color), tps)
                t.add_row(Text(""), line2_name, mem, hop_t, batch_t)
        return t

    def _cluster_line(self, snap: dict) -> Text:
        c = snap.get("cluster", {})
        t = Text.assemble(
            ("memory ", "dim"), "total ", (fmt_bytes(c.get("memory_total_bytes")), "bold"),
            " · usable ", (fmt_bytes(c.get("memory_usable_bytes")), "bold"),
            " · used ", (fmt_bytes(c.get("memory_used_bytes")), "bold"),
        )
        t.no_wrap = True
        t.overflow = "ellipsis"
        return t

    def _requests_title(self, snap: dict) -> str:
        total = snap.get("cluster", {}).get("tokens_generated_total")
        return "recent requests" + (f" · {total:,} tokens served" if total is not None else "")

    def _requests(self, recent: list[dict], n: int) -> Table:
        t = Table(box=None, padding=(0, 2, 0, 0), pad_edge=False, header_style="dim", expand=False)
        for col, just in (("request", "left"), ("prompt", "right"), ("out", "right"), ("TTFT", "right"),
                          ("tok/s", "right")):
            t.add_column(col, justify=just, no_wrap=True, overflow="ellipsis")
        if not recent:
            t.add_row(Text("none yet", style="dim"), "", "", "", "")
        for r in recent[:n]:
            rid = str(r.get("request_id") or DASH)
            t.add_row(rid[:10], _plain_int(r.get("prompt_tokens")), _plain_int(r.get("completion_tokens")),
                      fmt_seconds(_f(r.get("ttft_s"))), fmt_rate(_f(r.get("tokens_per_s"))))
        return t

    def _events(self, events: list[dict], height: int | None, limit: int | None = None) -> Iterator:
        yield Rule("events", align="left", style="dim")
        if height is not None and height <= 1:
            return
        n = limit if limit is not None else (8 if height is None else height - 1)
        shown = sorted(events, key=lambda e: ts_key(e.get("ts")))[-n:] if n > 0 else []
        if not shown:
            yield Text("nothing yet", style="dim")
            return
        kind_w = min(9, max((len(str(e.get("kind") or "")) for e in shown), default=4))
        t = Table.grid(padding=(0, 1), expand=True)
        t.add_column(no_wrap=True, style="dim", min_width=8)
        t.add_column(no_wrap=True, min_width=kind_w, max_width=kind_w)
        t.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        for e in shown:
            kind = str(e.get("kind") or "")
            style = "red" if kind in ("error", "leave", "suspect", "lost") else "yellow" if kind in (
                "warning", "replan", "re-plan") else "green" if kind in ("join", "back", "connected") else ""
            t.add_row(fmt_ts(e.get("ts")), Text(kind[:9], style=style), Text(str(e.get("message") or "")))
        yield t


def _f(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _plain_int(v: Any) -> str:
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else DASH


# --------------------------------------------------------------------------- events


class EventTracker:
    """Events the dashboard sees happen between snapshots: contact lost and regained,
    and -- when the daemon keeps no event log of its own -- joins, leaves, re-plans
    and state changes (``ready`` <-> ``serving`` is not an event)."""

    def __init__(self, maxlen: int = 200):
        self.events: deque[dict] = deque(maxlen=maxlen)
        self._prev: dict | None = None
        self._reachable: bool | None = None

    def add(self, kind: str, message: str, ts: float | None = None) -> None:
        self.events.append({"ts": time.time() if ts is None else ts, "kind": kind, "message": message})

    def observe(self, snap: dict) -> dict:
        """Record what changed since the last snapshot; returns ``snap`` with its events
        merged with the tracked ones (oldest first)."""
        now = snap.get("taken_at") or time.time()
        if snap.get("reachable") != self._reachable:
            if snap.get("reachable"):
                self.add("connected" if self._reachable is None else "back", f"reached {snap.get('source')}", now)
            else:
                self.add("lost", f"cannot reach the cluster: {snap.get('error')}", now)
            self._reachable = snap.get("reachable")
        own_log = bool(snap.get("events"))
        prev = self._prev
        if snap.get("reachable"):
            if prev is not None and not own_log:
                self._diff(prev, snap, now)
            self._prev = snap
        merged = [e for e in snap.get("events", [])]
        merged += [e for e in self.events if e not in merged]
        merged.sort(key=lambda e: ts_key(e.get("ts")))
        return dict(snap, events=merged)

    def _diff(self, prev: dict, cur: dict, now: float) -> None:
        pc, cc = prev.get("cluster", {}), cur.get("cluster", {})
        if pc.get("epoch") is not None and cc.get("epoch") is not None and pc["epoch"] != cc["epoch"]:
            ranges = ", ".join(f"{n['name']} {fmt_range(n['layer_range'])}" for n in cur["nodes"] if n["in_plan"])
            self.add("replan", f"epoch {pc['epoch']} → {cc['epoch']}: {ranges}", now)
        before = {n["address"]: n for n in prev.get("nodes", [])}
        after = {n["address"]: n for n in cur.get("nodes", [])}
        for addr, n in after.items():
            if addr not in before:
                self.add("join", f"{n['name']} appeared ({n['state'] or DASH})", now)
                continue
            old = before[addr]["state"]
            new = n["state"]
            if old != new and {old, new} != {"ready", "serving"}:
                kind = "suspect" if new in ("suspect", "unreachable") else "back" if old in (
                    "suspect", "unreachable") else "state"
                self.add(kind, f"{n['name']}: {old or DASH} → {new or DASH}", now)
        for addr, n in before.items():
            if addr not in after:
                self.add("leave", f"{n['name']} left", now)


class _LogToEvents(logging.Handler):
    """Warnings and errors logged in this process, as dashboard events."""

    def __init__(self, tracker: EventTracker):
        super().__init__(logging.WARNING)
        self.tracker = tracker

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.tracker.add("error" if record.levelno >= logging.ERROR else "warning", record.getMessage(),
                             record.created)
        except Exception:  # a log handler must never raise
            self.handleError(record)


@contextlib.contextmanager
def _logs_through(stream) -> Iterator[None]:
    """Point the root logger's stderr/stdout handlers at ``stream`` (the live display's
    proxy, so log lines scroll above the dashboard instead of tearing it)."""
    root = logging.getLogger()
    swapped = []
    for h in root.handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and h.stream in (
                sys.__stderr__, sys.__stdout__):
            swapped.append((h, h.setStream(stream)))
    try:
        yield
    finally:
        for h, old in swapped:
            h.setStream(old)


# --------------------------------------------------------------------------- live loop


@contextlib.contextmanager
def _quit_key(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Iterator[None]:
    """``q`` quits (when stdin is a terminal); Ctrl-C keeps working."""
    try:
        import termios
        import tty

        fd = sys.stdin.fileno()
        if not sys.stdin.isatty():
            raise OSError
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield
        return

    def on_key() -> None:
        try:
            ch = sys.stdin.read(1)
        except (OSError, ValueError):
            return
        if ch in ("q", "Q"):
            stop.set()

    tty.setcbreak(fd)
    loop.add_reader(fd, on_key)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def run_live(collector: Collector, stop: asyncio.Event, *, console: Console | None = None,
                   interval_s: float = DEFAULT_INTERVAL_S, screen: bool = False,
                   tracker: EventTracker | None = None) -> None:
    """Poll ``collector`` every ``interval_s`` and redraw in place until ``stop`` is set."""
    from rich.live import Live

    console = console or Console()
    tracker = tracker or EventTracker()
    loop = asyncio.get_running_loop()
    last_good: dict | None = None
    with Live(console=console, auto_refresh=False, screen=screen, transient=False,
              redirect_stdout=not screen, redirect_stderr=not screen, vertical_overflow="crop") as live:
        with _logs_through(sys.stderr):
            while not stop.is_set():
                started = loop.time()
                snap = tracker.observe(await collector.snapshot())
                height = console.height if screen else max(10, console.height - 1)
                live.update(render(snap, height=height, last_good=last_good, live=True), refresh=True)
                if snap["reachable"]:
                    last_good = snap
                delay = max(0.05, interval_s - (loop.time() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)


async def live_dashboard(api_url: str, stop: asyncio.Event, api_key: str | None = None) -> None:
    """The dashboard of ``ringlet run`` in an interactive terminal, until ``stop`` is set.

    Draws inline (not on the alternate screen), so the last frame stays on the
    terminal; log lines of the daemon scroll above it, and its warnings and errors
    also appear in the event log.
    """
    collector = Collector([api_url], timeout_s=1.0, api_key=api_key)
    tracker = EventTracker()
    handler = _LogToEvents(tracker)
    logging.getLogger().addHandler(handler)
    try:
        await run_live(collector, stop, tracker=tracker, screen=False)
    finally:
        logging.getLogger().removeHandler(handler)
        await collector.aclose()


async def _dashboard_main(api_urls: list[str], interval_s: float, screen: bool, api_key: str | None = None) -> None:
    collector = Collector(api_urls, timeout_s=max(0.5, min(2.0, 2 * interval_s)), api_key=api_key)
    stop = asyncio.Event()
    try:
        with _quit_key(asyncio.get_running_loop(), stop):
            await run_live(collector, stop, interval_s=interval_s, screen=screen)
    finally:
        await collector.aclose()


def run_dashboard(args) -> int:
    """``ringlet dashboard [--api URL ...] [--once] [--interval S]``."""
    from ringlet.daemon.errors import RingletError
    from ringlet.daemon.ops.status import default_api_url, take_snapshot
    from ringlet.daemon.wire.auth import client_api_key

    urls = [normalize_api_url(u) for u in (args.api or [default_api_url()])]
    api_key = client_api_key(getattr(args, "api_key_file", None))
    if args.once:
        snap = take_snapshot(urls, timeout_s=2.0, api_key=api_key)
        snap = EventTracker().observe(snap)
        console = Console()
        console.print(render(snap))
        return 0 if snap["reachable"] else 1
    try:
        interval = float(args.interval)
    except (TypeError, ValueError):
        raise RingletError(f"--interval {args.interval!r}: not a number of seconds") from None
    if not 0.05 <= interval <= 60:
        raise RingletError(f"--interval {interval}: give between 0.05 and 60 seconds (default 0.5, i.e. 2 Hz)")
    try:
        asyncio.run(_dashboard_main(urls, interval, screen=not args.inline, api_key=api_key))
    except KeyboardInterrupt:
        pass
    return 0
