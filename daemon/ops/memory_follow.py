"""The memory a node offers the planner, and following it while the daemon runs.

What a node offers is the lowest of the memory probe's figure (host RAM rule, macOS wired
limit / Metal working set, the daemon's own cgroup: :mod:`ringlet.daemon.probes.memory`)
and ``--memory-limit``; the boundary activations' budget is kept off it. Its record carries
the figure (``usable_memory_bytes``) and, in words, the rule that set it
(``usable_memory_source``), which ``/v1/cluster``, ``ringlet status`` and ``ringlet
doctor`` show.

A limit changed while the daemon runs (``systemctl set-property ... MemoryMax=``,
``docker update --memory``, a write to ``memory.limit_in_bytes`` / ``memory.max``) is seen
by a poll of the cgroup files every :data:`POLL_S` seconds (a few small files). A new
limit, a new rule, or a figure that moved by :data:`CHANGE_FRACTION` or more is advertised
(a new record version, which the peers fetch) and asks for a re-plan, here and on every
peer that fetches the newer record (:meth:`MemoryFollower.record_changed`): the proposer
plans with it, and a plan that no longer fits becomes a 503 with the reason. Smaller
moves (the cgroup's other processes breathing) are not advertised, so the plan does not
churn. Each poll also reads the kernel's memory-pressure signals, and under pressure the
node sheds its stores and offers less (:mod:`.memory_pressure`, :meth:`MemoryFollower.cap`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ringlet.daemon.ops.lane_child import read_share
from ringlet.daemon.ops.memory_pressure import PressureResponder
from ringlet.daemon.ops.run_options import parse_size
from ringlet.daemon.probes.memory import MemoryInfo, probe_memory, size_text, with_cgroup
from ringlet.daemon.probes.memory_pressure import PressureReading, read_pressure

log = logging.getLogger(__name__)

__all__ = ["CHANGE_FRACTION", "POLL_S", "MemoryFollower", "configured_memory", "offered_memory"]

#: Seconds between two reads of the cgroup's limit.
POLL_S = 2.0
#: A usable figure that moved by less than this share (same limit, same rule) is not re-advertised.
CHANGE_FRACTION = 0.05
#: The rule of a lane's share, in words (ops/lanes.py).
SHARE_RULE = "what the node's higher-priority models leave"


def offered_memory(memory: MemoryInfo, flag_bytes: int | None, flag_rule: str = "--memory-limit") -> tuple[int, str]:
    """``(bytes, rule in words)``: the probe's usable memory, or ``--memory-limit``
    (``flag_bytes``; ``flag_rule`` names where it came from) where that is lower."""
    if flag_bytes is not None and flag_bytes < memory.usable_memory_bytes:
        return flag_bytes, f"{flag_rule}: {size_text(flag_bytes)}"
    return memory.usable_memory_bytes, memory.usable_source or memory.usable_rule


def lowest_limit(flag_bytes: int | None, share_bytes: int | None) -> tuple[int | None, str]:
    """``(limit, rule)``: the lower of ``--memory-limit`` (``flag_bytes``) and a lane's share
    (``share_bytes``, ops/lanes.py), with the rule :func:`offered_memory` names; ``None``
    for neither."""
    if share_bytes is not None and (flag_bytes is None or share_bytes < flag_bytes):
        return share_bytes, SHARE_RULE
    return flag_bytes, "--memory-limit"


def _node_bytes(memory: MemoryInfo, flag_bytes: int | None) -> int | None:
    """What the node sizes its own stores from (``NodeConfig.usable_memory_bytes``):
    ``--memory-limit`` as always, or where the cgroup rule binds lower, that figure
    (``None``: neither, the node shares the machine's RAM with its co-located daemons)."""
    if memory.usable_rule.startswith("cgroup"):
        return offered_memory(memory, flag_bytes)[0]
    return flag_bytes


def configured_memory(args) -> int | None:
    """``NodeConfig.usable_memory_bytes`` for ``ringlet run``'s ``args``: ``--memory-limit``,
    lowered to the cgroup's usable memory when one binds (probed now)."""
    flag = parse_size(getattr(args, "memory_limit", None))
    return _node_bytes(probe_memory(), flag)


class MemoryFollower:
    """This node's offered memory: its record fields, and a poll that follows the cgroup.

    Args:
        node: the :class:`~ringlet.daemon.node.Node` (its config, boundary budget, events).
        memory: the memory probe at start.
        flag_bytes: ``--memory-limit`` in bytes, or ``None``.
        interval_s: seconds between two polls.
        refresh: ``MemoryInfo -> MemoryInfo`` with the cgroup read anew
            (:func:`~ringlet.daemon.probes.memory.with_cgroup`; tests give their own).
        share_file: a model's lane of a node serving several (``--lane-share-file``,
            ops/lanes.py): the memory the models before it leave, read at each poll and
            offered where lower than the rest.
    """

    def __init__(self, node, memory: MemoryInfo, flag_bytes: int | None, *, interval_s: float = POLL_S,
                 refresh: Callable[[MemoryInfo], MemoryInfo] = with_cgroup,
                 pressure_read: Callable[[], PressureReading] = read_pressure, share_file: str | None = None):
        self.node = node
        self.memory = memory
        self.share_file = share_file
        self.cli_flag_bytes = flag_bytes  # --memory-limit as given
        self.flag_bytes, self.flag_rule = lowest_limit(flag_bytes, read_share(share_file))
        self.interval_s = interval_s
        self.refresh = refresh
        self.cap_bytes: int | None = None  # a lower offer under memory pressure (memory_pressure.py)
        self.pressure = PressureResponder(self, pressure_read)
        node.pressure = self.pressure  # /v1/cluster's memory.pressure
        self.membership = None
        self.negotiator = None
        self._peers: dict[str, int | None] = {}  # member id -> the usable memory last seen in its record
        self._task: asyncio.Task | None = None
        self._sizing: asyncio.Task | None = None  # the prefix store's new budget, set on the MLX thread
        self._size_stores()

    def _size_stores(self) -> None:
        """The node sizes its own stores from this figure too (``NodeConfig.usable_memory_bytes``:
        ``--memory-limit``, or the cgroup's where it binds): the boundary store at once, the
        prefix store on the MLX thread (it evicts down to its new budget)."""
        self.node.config.usable_memory_bytes = _node_bytes(self.memory, self.flag_bytes)
        if self.memory.runtime_bytes is not None:
            self.node.runtime_bytes = self.memory.runtime_bytes
        engine = getattr(self.node, "engine", None)
        boundaries = getattr(engine, "boundaries", None)
        stores_off = getattr(self.node, "stores_off", False)  # shed under memory pressure
        if boundaries is not None and hasattr(boundaries, "budget_bytes"):
            boundaries.budget_bytes = 0 if stores_off else self.node.boundary_budget()
        if engine is not None and hasattr(engine, "kv_room") and hasattr(self.node, "kv_room_for"):
            engine.kv_room = self.node.kv_room_for(engine.stage)  # the KV room follows the figure too
        prefix = getattr(engine, "prefix", None)
        if prefix is None or not hasattr(engine, "run") or stores_off:
            return
        budget = self.node.prefix_budget(engine.stage)
        with contextlib.suppress(RuntimeError):  # no running loop: sized at the next commit
            self._sizing = asyncio.get_running_loop().create_task(engine.run(prefix.set_budget, budget))

    def fields(self) -> dict:
        """The record's memory fields: ``memory_total_bytes``, ``usable_memory_bytes`` (what
        the planner may fill: the offered memory less the boundary activations' budget),
        ``usable_memory_source`` (the rule in words, with what is kept off) and
        ``boundary_cache_bytes``. Kept off: the boundary activations' budget and one step's
        activations (the node's ``work_space_bytes``) and its tokenizer (``tokenizer_bytes``)."""
        usable, source = offered_memory(self.memory, self.flag_bytes, self.flag_rule)
        if self.cap_bytes is not None and self.cap_bytes < usable:
            usable, source = self.cap_bytes, f"memory pressure: {size_text(self.cap_bytes)} (the rule: {source})"
        boundary, work = self.node.boundary_budget(), getattr(self.node, "work_space_bytes", 0)
        tokenizer = getattr(self.node, "tokenizer_bytes", 0)
        kept = [f"{size_text(boundary)} for boundary activations"] if boundary else []
        kept += [f"{size_text(work)} for one step's activations"] if work else []
        kept += [f"{size_text(tokenizer)} for the tokenizer"] if tokenizer else []
        if kept:
            source += f"; {kept[0].replace(' for ', ' of it kept for ', 1)}" + "".join(f" and {k}" for k in kept[1:])
        return {"memory_total_bytes": self.memory.total_bytes,
                "usable_memory_bytes": max(0, usable - boundary - work - tokenizer),
                "usable_memory_source": source, "boundary_cache_bytes": boundary}

    def offered_bytes(self) -> int:
        """What the node offers before the stores and work space are kept off, bytes: the
        rule's figure or ``--memory-limit``, or less under memory pressure (:meth:`cap`)."""
        usable = offered_memory(self.memory, self.flag_bytes, self.flag_rule)[0]
        return min(usable, self.cap_bytes) if self.cap_bytes is not None else usable

    def cap(self, nbytes: int | None) -> None:
        """Offer at most ``nbytes`` (``None``: the rule's figure again): advertised at once,
        with a re-plan."""
        if nbytes == self.cap_bytes:
            return
        self.cap_bytes = nbytes
        self._advertise()

    def _advertise(self) -> None:
        if self.membership is not None:
            self.membership.set_record({**self.membership.own_record, **self.fields()})
        if self.negotiator is not None:
            self.negotiator.membership_changed()  # plan with the new figure (the proposer acts)

    def start(self, membership, negotiator) -> asyncio.Task:
        """Poll every ``interval_s`` (an asyncio task the caller cancels); re-plans go to ``negotiator``."""
        self.membership, self.negotiator = membership, negotiator
        self._task = asyncio.create_task(self._run(), name="memory")
        return self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                new = await loop.run_in_executor(None, self.refresh, self.memory)
            except Exception as exc:  # noqa: BLE001 - a poll must never end the daemon
                log.debug("memory poll failed: %s", exc)
                continue
            if self.share_file is not None:
                with contextlib.suppress(Exception):
                    self.follow_share()
            try:  # first: what the node sheds is said before a new figure resizes the stores
                await self.pressure.poll()
            except Exception as exc:  # noqa: BLE001 - a poll must never end the daemon
                log.debug("memory pressure poll failed: %s", exc)
            with contextlib.suppress(Exception):
                self.update(new)

    def update(self, new: MemoryInfo) -> bool:
        """Take a fresh probe: when the limit or rule changed, or the figure moved by
        :data:`CHANGE_FRACTION` or more, advertise it and ask for a re-plan. Returns whether
        it was advertised."""
        old = self.memory
        before, after = offered_memory(old, self.flag_bytes)[0], offered_memory(new, self.flag_bytes)[0]
        moved = abs(after - before) >= CHANGE_FRACTION * max(1, before)
        if not moved and (old.cgroup_limit_bytes, old.usable_rule) == (new.cgroup_limit_bytes, new.usable_rule):
            return False
        self.memory = new
        self._announce(before, after)
        return True

    def follow_share(self) -> bool:
        """A lane's share file (``share_file``) read anew: a new figure lowers (or raises) the
        offer as a changed ``--memory-limit`` would, never past ``--memory-limit`` as given,
        advertised with a re-plan when it moved by :data:`CHANGE_FRACTION` or more. Returns
        whether it was advertised."""
        share = read_share(self.share_file)
        if share is None:
            return False
        flag, rule = lowest_limit(self.cli_flag_bytes, share)
        if (flag, rule) == (self.flag_bytes, self.flag_rule):
            return False
        before = self.offered_bytes()
        self.flag_bytes, self.flag_rule = flag, rule
        after = self.offered_bytes()
        if abs(after - before) < CHANGE_FRACTION * max(1, before):
            return False
        self._announce(before, after)
        return True

    def _announce(self, before: int, after: int) -> None:
        """A new offer (``before`` -> ``after`` bytes): the stores resized, logged, an event,
        advertised with a re-plan."""
        self._size_stores()
        message = f"usable memory {size_text(before)} -> {size_text(after)}: {self.fields()['usable_memory_source']}"
        log.info("%s", message)
        self.node.event("memory", message)
        self._advertise()

    def record_changed(self, member) -> None:
        """A peer's newer record: when its usable memory differs from the last one seen here
        (or none was seen), re-plan (the proposer plans with it; the others' rounds, and a
        round whose plan is the committed one, find nothing to do)."""
        usable = (member.record or {}).get("usable_memory_bytes")
        if self._peers.get(member.node_id, -1) != usable and self.negotiator is not None:
            log.info("member %s offers %s usable: planning with it", member.node_id, size_text(usable or 0))
            self.negotiator.membership_changed()
        self._peers[member.node_id] = usable
