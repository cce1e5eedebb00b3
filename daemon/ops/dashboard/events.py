"""The dashboard's event log, completed by what it sees change between snapshots
(:class:`EventTracker`): contact lost and regained, and -- when the daemon keeps no
event log of its own -- joins, leaves, re-plans and state changes."""

from __future__ import annotations

import time
from collections import deque

from ringlet.daemon.ops.format import DASH, fmt_range, ts_key


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
