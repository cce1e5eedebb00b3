"""What a node does when other programs take memory after the plan: shed, then offer less.

Each poll of the memory follower (:mod:`.memory_follow`) reads the kernel's signals
(:mod:`ringlet.daemon.probes.memory_pressure`). Under pressure the node, in this order:

1. **sheds what it can rebuild**, at once: the prefix store (its entries are recomputed by
   a later prefill, its disk tier is kept), the boundary store and MLX's buffer cache;
   both stores stay empty (budget 0) while the pressure lasts;
2. **offers less**, when the pressure is still there :data:`CUT_AFTER_S` seconds later: its
   offer drops to :data:`CUT_FRACTION` less than the stage it was planned (a re-plan moves
   layers off it; the cut repeats every :data:`CUT_AFTER_S` while the pressure stays);
3. when no signal was seen for :data:`CALM_S` seconds, **turns back**: the stores get their
   budgets again and the offer its rule's figure (a re-plan may give the layers back).

An allocation that fails anyway (MLX on Metal says so; :mod:`ringlet.daemon.engine.kv_room`)
takes steps 1 and 2 at once.

Every step is an event (``memory`` kind) and ``/v1/cluster``'s ``memory_pressure`` (shown
by ``ringlet status``) says what holds now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ringlet.daemon.probes.memory import size_text
from ringlet.daemon.probes.memory_pressure import PressureReading, pressure_reason, read_pressure

log = logging.getLogger(__name__)

__all__ = ["CALM_S", "CUT_AFTER_S", "CUT_FRACTION", "PressureResponder"]

#: Seconds of pressure after shedding before the node offers less (and between two cuts).
CUT_AFTER_S = 4.0
#: Share of its planned stage a cut takes off the node's offer.
CUT_FRACTION = 0.25
#: Seconds without any signal before the node turns its stores and offer back.
CALM_S = 15.0


def _clear_mlx_cache() -> int:
    """Free MLX's buffer cache; the bytes it held."""
    import mlx.core as mx

    held = int(mx.get_cache_memory())
    mx.clear_cache()
    return held


class PressureResponder:
    """One node's answer to memory pressure (module docstring).

    Args:
        follower: the node's :class:`~.memory_follow.MemoryFollower` (its node, and
            :meth:`~.memory_follow.MemoryFollower.cap` to offer less).
        read: ``() -> PressureReading`` (:func:`read_pressure`; tests give their own).
        clock: seconds, monotonic.
    """

    def __init__(self, follower, read: Callable[[], PressureReading] = read_pressure,
                 clock: Callable[[], float] = time.monotonic):
        self.follower, self.read, self.clock = follower, read, clock
        self.node = follower.node
        self.reason: str | None = None
        self.since: float | None = None
        self.calm_since: float | None = None
        self.last_step = 0.0
        self.shed_bytes = 0
        self.cuts = 0
        self._before: PressureReading | None = None

    def info(self) -> dict | None:
        """``/v1/cluster``'s ``memory_pressure``: ``None`` when there is none, else the
        reason, seconds since it began, bytes shed and the cuts made to the offer."""
        if self.since is None:
            return None
        return {"reason": self.reason, "for_s": round(self.clock() - self.since, 1), "shed_bytes": self.shed_bytes,
                "cuts": self.cuts, "offered_bytes": self.follower.cap_bytes}

    async def poll(self) -> None:
        """Read the signals once and take the step they call for."""
        reading = await asyncio.get_running_loop().run_in_executor(None, self.read)
        reason, self._before = pressure_reason(reading, self._before), reading
        now = self.clock()
        if reason is not None:
            self.calm_since = None
            if self.since is None:
                self.since, self.reason, self.last_step = now, reason, now
                await self._shed(reason)
            elif now - self.last_step >= CUT_AFTER_S:
                self.last_step, self.reason = now, reason
                self._cut(reason)
        elif self.since is not None:
            self.calm_since = self.calm_since if self.calm_since is not None else now
            if now - self.calm_since >= CALM_S:
                await self._restore(now - self.since)

    def allocation_failed(self, what: str) -> asyncio.Task:
        """An allocation failed on this node anyway (MLX's words): shed at once and offer
        less at once, as pressure that already stayed; the calm period then turns it back.
        Returns the task doing it (on the running loop)."""
        reason = f"an allocation failed ({what})"

        async def act() -> None:
            now = self.clock()
            if self.since is None:
                self.since, self.reason = now, reason
                await self._shed(reason)
            self.last_step, self.calm_since = now, None
            self._cut(reason)

        return asyncio.get_running_loop().create_task(act())

    async def _shed(self, reason: str) -> None:
        node = self.node
        node.stores_off = True
        engine = getattr(node, "engine", None)
        prefix = boundary = cache = 0
        if engine is not None:
            prefix = engine.prefix.nbytes
            boundary = engine.boundaries.nbytes
            await engine.run(engine.prefix.set_budget, 0)
            await engine.run(engine.boundaries.set_budget, 0)
            cache = await engine.run(_clear_mlx_cache)
        self.shed_bytes = prefix + boundary + cache
        message = (f"memory pressure: {reason}; shed {size_text(self.shed_bytes)} it can rebuild (prefix store "
                   f"{size_text(prefix)}, boundary store {size_text(boundary)}, MLX cache {size_text(cache)}); "
                   f"the stores stay empty until it passes")
        log.warning("%s", message)
        node.event("memory", message)

    def _cut(self, reason: str) -> None:
        stage = getattr(getattr(self.node, "engine", None), "stage", None)
        weights = stage.nbytes() if stage is not None and hasattr(stage, "nbytes") else 0
        planned = self.node.planned_stage_bytes(weights) if weights else 0
        before = self.follower.offered_bytes()
        offer = int(min(before, planned) * (1.0 - CUT_FRACTION))
        self.cuts += 1
        message = (f"memory pressure stays: {reason}; offering {size_text(offer)} (was {size_text(before)}) "
                   f"and re-planning")
        log.warning("%s", message)
        self.node.event("memory", message)
        self.follower.cap(offer)

    async def _restore(self, lasted_s: float) -> None:
        node = self.node
        node.stores_off = False
        self.since = self.calm_since = self.reason = None
        self.cuts = self.shed_bytes = 0
        engine = getattr(node, "engine", None)
        if engine is not None:
            await engine.run(engine.boundaries.set_budget, node.boundary_budget())
            await engine.run(engine.prefix.set_budget, node.prefix_budget(engine.stage))
        message = f"memory pressure passed after {lasted_s:.0f} s: the stores are back on"
        if self.follower.cap_bytes is not None:
            message += "; offering the rule's figure again"
        log.info("%s", message)
        node.event("memory", message)
        self.follower.cap(None)
