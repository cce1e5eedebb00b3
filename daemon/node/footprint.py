"""What a node plans to hold and what it holds: its stores' budgets and its memory figures.

A node's planned footprint is the sum of what it told the planner and what it keeps for
itself (all bytes):

- ``runtime``: the empty daemon (interpreter, gRPC, MLX), measured before any model;
- ``stage``: the plan's figure for its layer range, weights and the KV caches at the
  planned context (``plan_detail.stages[].memory_bytes``);
- ``boundary``: the boundary activations' budget (:meth:`MemoryAccounting.boundary_budget`);
- ``work_space``: one step's activations (:mod:`ringlet.daemon.engine.work_space`), which
  is also MLX's buffer-cache limit here;
- ``prefix``: the prefix store's budget, a share of what those leave free.

The node offers the planner its usable memory less ``boundary`` and ``work_space``
(:mod:`ringlet.daemon.ops.memory_follow`), so ``runtime + the offer + boundary +
work_space`` is the usable rule's figure plus the runtime, and the planned total never
exceeds it. ``/v1/cluster`` shows the planned figures beside the measured ones (RSS, MLX's
active and peak memory, the cgroup's peak where there is one).
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil

from ringlet.daemon.engine.defaults import DEFAULT_BOUNDARY_CACHE_BYTES
from ringlet.daemon.engine.kv_room import KVRoom
from ringlet.daemon.engine.stage import Stage
from ringlet.daemon.node.config import PREFIX_CACHE_FRACTION
from ringlet.daemon.node.memory import mlx_memory_bytes, peak_rss_bytes
from ringlet.daemon.paths import machine_cache_dir
from ringlet.daemon.probes import colocated
from ringlet.daemon.probes.cgroup_memory import cgroup_peak_bytes

__all__ = ["MemoryAccounting"]


class MemoryAccounting:
    """The memory side of :class:`~ringlet.daemon.node.Node` (a mixin; it reads the node's
    ``config``, ``engine``, ``plan``, ``node_id`` and ``memory``).

    Attributes it sets: ``work_space_bytes`` (one step's activations, bytes; set by the
    runner once it knows the model, 0 before) and ``runtime_bytes`` (the empty daemon's
    memory, bytes, as the memory probe measured it; ``None``: not measured).
    """

    work_space_bytes: int = 0
    #: what its tokenizer takes once built (set by the runner; engine/work_space.py)
    tokenizer_bytes: int = 0
    runtime_bytes: int | None = None
    #: the prefix and boundary stores are shed while memory is under pressure (ops/memory_pressure.py)
    stores_off: bool = False
    #: the node's :class:`~ringlet.daemon.ops.memory_pressure.PressureResponder`, if any
    pressure: Any = None
    #: the model's KV bytes per token per layer (set by the runner; ``None``: KV room unchecked)
    kv_bytes_per_token_per_layer: tuple[float, ...] | None = None

    def _usable_memory(self) -> int:
        """``--memory-limit`` or the cgroup's figure, else the machine's memory shared by the
        ringlet processes on it, bytes."""
        if self.config.usable_memory_bytes is not None:
            return self.config.usable_memory_bytes
        return psutil.virtual_memory().total // colocated.count(machine_cache_dir() / colocated.DIR_NAME)

    def boundary_budget(self) -> int:
        """Bytes of boundary activations this node keeps: ``--boundary-cache-bytes``, else a
        sixteenth of its usable memory, at most
        :data:`~ringlet.daemon.engine.defaults.DEFAULT_BOUNDARY_CACHE_BYTES`. The planner
        is offered the memory without it."""
        if self.config.boundary_cache_bytes is not None:
            return max(0, self.config.boundary_cache_bytes)
        return min(DEFAULT_BOUNDARY_CACHE_BYTES, self._usable_memory() // 16)

    def kept_off_bytes(self) -> int:
        """What this node keeps off its offer to the planner besides its runtime, bytes: the
        boundary budget, the work space and the tokenizer."""
        return self.boundary_budget() + self.work_space_bytes + self.tokenizer_bytes

    def planned_stage_bytes(self, weights_bytes: int, plan=None) -> int:
        """The figure of ``plan`` (default: the committed one) for this node's stage (weights
        and KV at the planned context), bytes; ``weights_bytes`` where the plan gives none (a
        static ``--plan``)."""
        detail = getattr(plan if plan is not None else self.plan, "detail", None) or {}
        for stage in detail.get("stages") or ():
            if stage.get("node_id") == self.node_id and isinstance(stage.get("memory_bytes"), int):
                return max(weights_bytes, stage["memory_bytes"])
        return weights_bytes

    def load_footprint(self, current, start: int, end: int, *, dropped: bool, plan=None) -> int:
        """Bytes this node holds while it loads ``[start, end)`` (a lane reserves them with
        its node: ops/lanes.py): its runtime, what it keeps off its offer, the new stage as
        ``plan`` (or the weights alone) plans it, and the old layers outside the new range
        unless they are dropped first."""
        layer_bytes = self.layer_bytes or ()
        weights = sum(layer_bytes[g] for g in range(start, min(end, len(layer_bytes))))
        stage = self.planned_stage_bytes(weights, plan) if plan is not None else weights
        held = 0
        if current is not None and not dropped:
            held = sum(layer_bytes[g] for g in range(current.start, min(current.end, len(layer_bytes)))
                       if not start <= g < end)
        return int(self._runtime_figure() + self.kept_off_bytes() + stage + held)

    def _runtime_figure(self) -> int:
        """The process's own memory in the footprint, bytes: the cgroup rule's runtime, else
        the RSS before the first stage loaded."""
        return self.runtime_bytes or self.memory.get("rss_before_load_bytes", 0)

    def prefix_budget_for(self, weights_bytes: int) -> int:
        """Bytes of prefix cache this node may hold beside a stage of ``weights_bytes``:
        ``--prefix-cache-bytes``, else :data:`~ringlet.daemon.node.config.PREFIX_CACHE_FRACTION`
        of the usable memory the planned stage (weights and KV at the planned context), the
        boundary store and the work space leave free; 0 while memory is under pressure."""
        if self.stores_off:
            return 0
        if self.config.prefix_cache_bytes is not None:
            return max(0, self.config.prefix_cache_bytes)
        held = self.planned_stage_bytes(weights_bytes) + self.kept_off_bytes()
        return int(PREFIX_CACHE_FRACTION * max(0, self._usable_memory() - held))

    def prefix_budget(self, stage) -> int:
        """Bytes this node's prefix store may hold under ``stage`` (:meth:`prefix_budget_for`
        its weights; a tensor group's stage: its own budget; 0 for another kind)."""
        own = getattr(stage, "prefix_store", None)  # a tensor group's stage: its budget is set
        if own is not None:
            return own.budget_bytes
        if not isinstance(stage, Stage):
            return 0
        return self.prefix_budget_for(stage.nbytes())

    def kv_room_for(self, stage) -> KVRoom | None:
        """The KV room of ``stage`` (:mod:`ringlet.daemon.engine.kv_room`): the usable memory
        less the stage's weights, the boundary budget and the work space; ``None`` for a stage
        of another kind or before the runner knew the model (``kv_bytes_per_token_per_layer``)."""
        per_layer = self.kv_bytes_per_token_per_layer
        if not isinstance(stage, Stage) or not per_layer:
            return None
        per_token = sum(per_layer[stage.start:stage.end])
        if per_token <= 0:
            return None
        budget = self._usable_memory() - stage.nbytes() - self.kept_off_bytes()
        return KVRoom(budget, per_token, self._kv_full, self._allocation_failed)

    def _allocation_failed(self, what: str) -> None:
        """An allocation failed anyway (from the MLX thread): memory pressure that calls for
        less at once (``PressureResponder.allocation_failed``, ops/memory_pressure.py)."""
        if self.pressure is not None:
            with contextlib.suppress(RuntimeError, AttributeError):  # no loop: the daemon is stopping
                self._loop.call_soon_threadsafe(self.pressure.allocation_failed, what)

    def _kv_full(self, tokens: int) -> None:
        """A step found no KV room (from the MLX thread): an event."""
        message = (f"a request needing KV for {tokens} tokens found no memory for it and ended; the node holds "
                   f"what it planned")
        with contextlib.suppress(RuntimeError, AttributeError):  # no loop: the daemon is stopping
            self._loop.call_soon_threadsafe(self.event, "memory", message)

    def planned_footprint(self, stage) -> dict[str, int]:
        """The planned footprint under ``stage`` (module docstring), bytes: ``runtime_bytes``,
        ``stage_bytes``, ``boundary_bytes``, ``work_space_bytes``, ``tokenizer_bytes``,
        ``prefix_bytes`` and their ``total_bytes``."""
        weights = stage.nbytes() if stage is not None else 0
        parts = {"runtime_bytes": self._runtime_figure(),
                 "stage_bytes": self.planned_stage_bytes(weights) if stage is not None else 0,
                 "boundary_bytes": self.boundary_budget(), "work_space_bytes": self.work_space_bytes,
                 "tokenizer_bytes": self.tokenizer_bytes,
                 "prefix_bytes": self.prefix_budget(stage) if stage is not None else 0}
        return {**parts, "total_bytes": sum(parts.values())}

    def memory_info(self, stage) -> dict[str, Any]:
        """What this node holds now, bytes (``/v1/cluster``'s ``memory``): the weights of
        its current layer range (``weights_bytes``), the KV caches of the requests in
        flight and the prefix store, MLX's active and peak memory, the process's RSS and
        peak RSS, the cgroup's peak (``cgroup_peak_bytes``, ``None`` outside one), the
        planned footprint (``planned``: :meth:`planned_footprint`), memory pressure
        (``pressure``: ``PressureResponder.info``, ``None``: none); ``first_load`` keeps
        the figures of the first stage load (the RSS of the empty daemon before it, MLX's
        active memory and the peak RSS right after)."""
        engine = self.engine
        active, peak = mlx_memory_bytes()
        return {
            "weights_bytes": stage.nbytes() if stage else 0,
            "kv_cache_bytes": engine.kv_cache_bytes() if engine else 0,
            "prefix_cache_bytes": engine.prefix.nbytes if engine else 0,
            "boundary_cache_bytes": engine.boundaries.nbytes + engine.boundaries.inflight_bytes if engine else 0,
            "mlx_active_bytes": active, "mlx_peak_bytes": peak,
            "rss_bytes": psutil.Process().memory_info().rss, "peak_rss_bytes": peak_rss_bytes(),
            "cgroup_peak_bytes": cgroup_peak_bytes(),
            "planned": self.planned_footprint(stage if isinstance(stage, Stage) else None),
            "pressure": self.pressure.info() if self.pressure is not None else None,
            "first_load": self.memory.get("first_load"),
        }
