"""One dashboard frame: :func:`render` (pure: a snapshot in, a rich renderable out).

What it draws, from a snapshot (:mod:`ringlet.daemon.ops.status.snapshot`):

- a header: model, depth, plan epoch, policy, mode, negotiation, how many stages
  are ready, requests in flight and the ring's tokens/s, and the time;
- **the ring**: the stages in plan order, one per row, each with its name, chip,
  state (``loading 45%`` with a bar while loading), memory used/total as a bar, its
  layer range drawn against the model's depth, tokens/s, its decode batch (mean
  over the last 10 s / limit, ``2.4/8``) and the hop to the next stage (link kind,
  bandwidth, RTT; the last row's hop returns to stage 0);
- **the models** (a node serving several): one line per model, in priority order: its
  state, its ring (or why it is left out) and what it holds of what it is offered;
- **the cluster**: total / usable / used memory and the last requests with their
  TTFT and tokens/s;
- **an event log**: the daemon's events (joins, leaves, re-plans, errors) plus
  what the dashboard itself saw change between snapshots.

Anything a daemon does not report is drawn as "—". :func:`render` is pure (a
snapshot in, a rich renderable out) and lays the frame out for the width it is
given: two lines per stage below 120 columns (readable at 80x24), one wide line
per stage from 120 columns on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from ringlet.daemon.ops.dashboard.model_panel import models_panel, models_rule
from ringlet.daemon.ops.dashboard.widgets import (
    STAGE_COLORS,
    chip_label,
    hop_text,
    layer_bar,
    memory_text,
    progress_of,
    state_text,
)
from ringlet.daemon.ops.format import (
    DASH,
    fmt_batch,
    fmt_bytes,
    fmt_range,
    fmt_rate,
    fmt_seconds,
    fmt_ts,
    main_word,
    mode_text,
    policy_text,
    ts_key,
)

#: Layout switch: one line per stage from this width on.
WIDE = 120


def render(snapshot: dict, *, height: int | None = None, last_good: dict | None = None,
           live: bool = False) -> Dashboard:
    """A rich renderable for ``snapshot`` (pure).

    Args:
        snapshot: from :func:`ringlet.daemon.ops.status.snapshot.build_snapshot`.
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
        models = snap.get("models") or []  # several models: a line each, below the first one's ring
        used = len(out) + (1 + len(models) if models else 0)
        dense = not wide and height is not None and used + 1 + 2 * len(nodes) + 7 > height
        out.append(self._ring_rule(snap))
        out.append(self._ring(snap, width, wide, dense))
        used += 1 + (len(nodes) if (wide or dense) else 2 * len(nodes)) + (1 if wide else 0)
        if models:
            out += [models_rule(models), models_panel(models, width)]
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
        ring = f"ring of {c['model']}" if snap.get("models") and c.get("model") else "ring"  # the first model's
        if len(names) > 1:
            title = f"{ring}: " + " → ".join(names + names[:1])
        elif names:
            title = f"{ring}: {names[0]} alone"
        else:
            title = f"{ring}: no plan"
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
            chip_w = max(4, min(24, max((len(chip_label(n)) for n in nodes), default=4)))
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
            for name, w, just in (("#", 2, "right"), ("node", name_w, "left"), ("chip · release", chip_w, "left"),
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
                t.add_row(idx, name, Text(chip_label(n)), state_text(n["state"], progress_of(n), 17),
                          rng + layer_bar(n["layer_range"], depth, bar_w, color), mem, tps, batch_t, hop_t)
            elif dense:
                t.add_row(idx, name, state_text(n["state"], progress_of(n), state_w),
                          rng + layer_bar(n["layer_range"], depth, bar_w, color), tps, batch_t)
            else:
                mem = memory_text(n["memory_used_bytes"], n["memory_total_bytes"], 5)
                line2_name = Text(chip_label(n), style="dim")
                t.add_row(idx, name, state_text(n["state"], progress_of(n), state_w),
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
        if c.get("prefix_bytes") is not None:
            disk = f" + {fmt_bytes(c['prefix_disk_bytes'])} on disk" if c.get("prefix_disk_bytes") else ""
            t.append_text(Text.assemble(" · prefix cache ", (fmt_bytes(c["prefix_bytes"]), "bold"), disk,
                                        f" {c.get('prefix_hits') or 0} hits/{c.get('prefix_misses') or 0} misses"))
        if (spec := c.get("speculation")) is not None:
            rate = spec.get("acceptance")
            t.append_text(Text.assemble(" · drafts ", (f"{spec['tokens_per_trip']:.2f}", "bold"), " tok/trip ",
                                        (f"{'—' if rate is None else f'{rate:.0%}'}", "bold"), " accepted"))
        if out := c.get("incompatible"):  # nodes of another wire protocol version (the events say why)
            t.append_text(Text.assemble(" · ", (f"{len(out)} kept out: other wire protocol", "bold red")))
        t.no_wrap = True
        t.overflow = "ellipsis"
        return t

    def _requests_title(self, snap: dict) -> str:
        total = snap.get("cluster", {}).get("tokens_generated_total")
        title = "recent requests" + (f" · {total:,} tokens served" if total is not None else "")
        for p in snap.get("prefilling") or []:  # requests prefilling now: tokens done of total, ETA
            eta = p.get("eta_s")
            title += (f" · prefilling {p.get('processed_tokens', DASH)}/{p.get('prompt_tokens', DASH)} ETA "
                      f"{fmt_seconds(eta if isinstance(eta, int | float) else None)}")
        return title

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
            style = "red" if kind in ("error", "leave", "suspect", "lost", "incompatible") else "yellow" if kind in (
                "warning", "replan", "re-plan") else "green" if kind in ("join", "back", "connected") else ""
            t.add_row(fmt_ts(e.get("ts")), Text(kind[:9], style=style), Text(str(e.get("message") or "")))
        yield t


def _f(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _plain_int(v: Any) -> str:
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else DASH
