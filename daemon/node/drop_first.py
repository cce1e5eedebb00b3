"""Drop before load: a node whose new layer range would not fit beside the one it serves.

A node prepares its stage of a new plan while the old plan still serves, reusing the
layers both ranges share and reading the others. For that time it holds the old range and
the layers it loads; when that is more than it offered the planner (a survivor of a lost
node that shifts to layers it does not hold, in a tight memory cgroup: #43), it would run
past its memory. Then it first drops the layers outside its new range: it stops serving
the old plan here (its requests in flight end there and resume on the new plan, as at any
re-plan after a loss) and loads into the memory they leave.
"""

from __future__ import annotations

import logging

from ringlet.daemon.engine.prune import inner_module, layer_list
from ringlet.daemon.engine.stage import Stage
from ringlet.daemon.probes.memory import size_text

log = logging.getLogger("ringlet.daemon.node")

__all__ = ["DropFirst"]


def _drop_layers(engine, stage: Stage, start: int, end: int) -> int:
    """On the MLX thread: the engine serves no stage, and ``stage`` keeps only its layers
    inside ``[start, end)`` (the others are freed); returns the bytes freed."""
    import mlx.core as mx

    before = stage.nbytes()
    engine.stage = None
    layers = layer_list(inner_module(stage.model))
    for g in range(stage.start, stage.end):
        if not start <= g < end:
            layers[g - stage.start] = None
    mx.clear_cache()
    return before - stage.nbytes()


class DropFirst:
    """The drop-before-load part of :class:`~ringlet.daemon.node.Node` (a mixin; it reads
    the node's ``engine`` and memory accounting).

    Attributes it reads: ``layer_bytes``, the weight bytes of each decoder layer (set by the
    runner from the model's spec; ``None``: not known, never drops).
    """

    layer_bytes: tuple[int, ...] | None = None

    def load_overfills(self, current: Stage | None, start: int, end: int) -> tuple[int, int, int] | None:
        """``(held, to load, offered)`` bytes when loading ``[start, end)`` beside
        ``current`` would pass what this node offers the planner (its usable memory less what
        it keeps off: boundary budget, work space, tokenizer), else ``None``."""
        if current is None or not self.layer_bytes or not isinstance(current, Stage):
            return None
        load = sum(self.layer_bytes[g] for g in range(start, min(end, len(self.layer_bytes)))
                   if not current.start <= g < current.end)
        offered = self._usable_memory() - self.kept_off_bytes()
        held = current.nbytes()
        return (held, load, offered) if load and held + load > offered else None

    async def drop_first(self, current: Stage, start: int, end: int, epoch: int,
                         figures: tuple[int, int, int]) -> int:
        """Drop ``current``'s layers outside ``[start, end)`` before loading it (module
        docstring); ``figures`` are :meth:`load_overfills`' for it. Returns the bytes freed."""
        held, load, offered = figures
        message = (f"dropping layers outside [{start}, {end}) before loading epoch {epoch}'s range: "
                   f"{size_text(held)} held and {size_text(load)} to load would pass the {size_text(offered)} "
                   f"this node offers; its requests in flight resume on the new plan")
        log.warning("%s", message)
        self.event("memory", message)
        self.state = "loading"
        return await self.engine.run(_drop_layers, self.engine, current, start, end)
