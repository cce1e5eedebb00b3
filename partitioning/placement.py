"""Several models in pooled memory: one ring per model, in priority order (issue #45).

:func:`place_models` plans the models one after another, highest priority first, each
with the single-model planner (:func:`~.planner.make_plan`) on the memory the models
before it leave:

    offered_i(n) = max(0, memory(n) - sum over placed j < i of used_j(n) - overhead)
    used_j(n)    = stage memory of model j on n (weights + KV at its context + its
                   embedding / head; ``Stage.memory_bytes``) + overhead, or 0 when
                   model j has no stage on n

where ``overhead`` (``per_model_overhead_bytes``) is what one model's process takes on
a node it runs on beyond its stage (its runtime). A node offering 0 is left out of that
model's ring as ``make_plan`` leaves out any node without memory. So:

* the first model gets exactly the plan the single-model planner gives it (its speed is
  kept); each next model gets the best plan the remainder allows;
* a model that does not fit in the remainder is left out with the reason and takes no
  memory; the models after it are still tried (a smaller one may fit), so a model is
  never left out for a lower-priority one;
* on every node, the placed models' ``used_j(n)`` sum to at most ``memory(n)``;
* removing a model changes no plan of a higher-priority one; with each model's previous
  plan (``previous``), an unchanged cluster keeps every ring and range (stickiness is
  ``make_plan``'s, per model).

The daemon runs one process per model on each machine (``daemon/ops/lanes.py``) and gives
model i's process ``offered_i(n)`` by the same rule from measured figures: there a higher
model's ``used_j(n)`` is its whole planned footprint on n (stage, stores, work space,
tokenizer, process), charged on every machine, also where it holds no stage or is left
out (its process runs there all the same). Pure: no I/O.
Units: bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from .errors import Infeasible
from .plan import Plan
from .planner import _fmt_bytes, make_plan
from .spec import LinkSpec, ModelSpec, NodeSpec, Policy, _whole

PLACEMENT_FORMAT = 1


@dataclass(frozen=True)
class Placement:
    """Where several models run in one cluster's pooled memory.

    Attributes:
        priority: every model's name, highest priority first (placed or left out).
        plans: name -> :class:`~.plan.Plan` of each placed model, in priority order.
            A stage's ``capacity_bytes`` is the memory offered to that model on the
            node (what the models before it left, less the overhead).
        left_out: name -> why the model is not served (for its 503), in priority order:
            the planner's :class:`~.errors.Infeasible` message, and whether it would fit
            alone and how many more bytes the models before it would have to leave.
        memory_bytes: node id -> the node's usable memory (the pool), sorted by id.
        memory_left: node id -> bytes no placed model uses, sorted by id (>= 0).
        overhead_bytes: per-model overhead charged on each node a model runs on.
    """

    priority: tuple[str, ...]
    plans: dict[str, Plan]
    left_out: dict[str, str]
    memory_bytes: dict[str, int]
    memory_left: dict[str, int]
    overhead_bytes: int = 0

    def used_bytes(self, name: str) -> dict[str, int]:
        """Node id -> bytes placed model ``name`` takes there (stage memory + overhead),
        for the nodes of its ring. Raises KeyError for a model that is not placed."""
        return {s.node_id: s.memory_bytes + self.overhead_bytes for s in self.plans[name].stages}

    def to_dict(self) -> dict:
        """A JSON-safe dict (``json.dumps`` works); :meth:`from_dict` inverts it."""
        return {
            "format": PLACEMENT_FORMAT,
            "priority": list(self.priority),
            "plans": {name: plan.to_dict() for name, plan in self.plans.items()},
            "left_out": dict(self.left_out),
            "memory_bytes": dict(self.memory_bytes),
            "memory_left": dict(self.memory_left),
            "per_model_overhead_bytes": self.overhead_bytes,
        }

    @classmethod
    def from_dict(cls, data: object) -> Placement:
        """Rebuild a placement from :meth:`to_dict` output.

        Raises:
            ValueError: not an object, an unsupported format, or a missing or mistyped
                field (named); a plan that does not match its id (see ``Plan.from_dict``).
        """
        if not isinstance(data, dict):
            raise ValueError(f"placement must be a JSON object, got {type(data).__name__}")
        if data.get("format") != PLACEMENT_FORMAT:
            raise ValueError(f"placement.format {data.get('format')!r} is not supported (expected {PLACEMENT_FORMAT})")
        for key, kind in (("priority", list), ("plans", dict), ("left_out", dict), ("memory_bytes", dict),
                          ("memory_left", dict), ("per_model_overhead_bytes", int)):
            if not isinstance(data.get(key), kind):
                raise ValueError(f"placement.{key} must be a JSON {'list' if kind is list else kind.__name__}")
        return cls(
            priority=tuple(str(x) for x in data["priority"]),
            plans={str(k): Plan.from_dict(v) for k, v in data["plans"].items()},
            left_out={str(k): str(v) for k, v in data["left_out"].items()},
            memory_bytes={str(k): int(v) for k, v in data["memory_bytes"].items()},
            memory_left={str(k): int(v) for k, v in data["memory_left"].items()},
            overhead_bytes=int(data["per_model_overhead_bytes"]),
        )


def place_models(
    nodes: Iterable[NodeSpec],
    links: Iterable[LinkSpec],
    models: Sequence[ModelSpec],
    *,
    previous: Mapping[str, Plan] | None = None,
    policy: Policy | None = None,
    per_model_overhead_bytes: int = 0,
) -> Placement:
    """Place ``models`` together on ``nodes``, highest priority first (module docstring).

    Args:
        nodes: the machines (any order; ids unique); ``memory_bytes`` is the whole pool
            the models share on that machine.
        links: measured direct links (any order), as for ``make_plan``.
        models: the models in priority order (first = highest); each is identified by
            its ``ModelSpec.name`` (unique) and planned at its own ``context_tokens``.
        previous: model name -> the plan it is served with now (stickiness; names not
            among ``models`` are ignored).
        policy: the policy every model is planned with (``Policy()`` by default).
        per_model_overhead_bytes: bytes one model's process takes on each node it runs
            on beyond its stage (its runtime), charged before the model is planned.

    Returns:
        A :class:`Placement`; the same for the nodes and links in any order.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: duplicate node ids or model names, a bad overhead, or what
            ``make_plan`` raises for bad inputs (never ``Infeasible``: a model that does
            not fit is left out with the reason).

    Complexity: one ``make_plan`` per model, and one more per model left out after a
    placed one (to say whether it fits alone).
    """
    nodes = sorted(nodes, key=lambda n: n.node_id if isinstance(n, NodeSpec) else "")
    links = list(links)
    models = list(models)
    previous = {} if previous is None else previous
    overhead = _check(nodes, models, previous, per_model_overhead_bytes)
    pool = {n.node_id: n.memory_bytes for n in nodes}
    left = dict(pool)
    plans: dict[str, Plan] = {}
    left_out: dict[str, str] = {}
    for model in models:
        try:
            plan = make_plan(_offer(nodes, left, overhead), links, model, previous=previous.get(model.name),
                             policy=policy)
        except Infeasible as exc:
            left_out[model.name] = _left_out_reason(exc, nodes, links, model, policy, overhead, list(plans))
            continue
        plans[model.name] = plan
        for s in plan.stages:
            left[s.node_id] -= s.memory_bytes + overhead
    return Placement(
        priority=tuple(m.name for m in models),
        plans=plans,
        left_out=left_out,
        memory_bytes=pool,
        memory_left=left,
        overhead_bytes=overhead,
    )


def _check(nodes: list, models: list, previous: object, overhead: object) -> int:
    for i, n in enumerate(nodes):
        if not isinstance(n, NodeSpec):
            raise TypeError(f"nodes[{i}] must be a NodeSpec, got {type(n).__name__}")
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        raise ValueError(f"nodes: duplicate node_id {dup!r}")
    names: set[str] = set()
    for i, m in enumerate(models):
        if not isinstance(m, ModelSpec):
            raise TypeError(f"models[{i}] must be a ModelSpec, got {type(m).__name__}")
        if m.name in names:
            raise ValueError(f"models: duplicate model name {m.name!r} (each model needs its own name)")
        names.add(m.name)
    if not isinstance(previous, Mapping):
        raise TypeError(f"previous must be a mapping of model name to Plan, got {type(previous).__name__}")
    for name, plan in previous.items():
        if not isinstance(plan, Plan):
            raise TypeError(f"previous[{name!r}] must be a Plan, got {type(plan).__name__}")
    return _whole(overhead, "per_model_overhead_bytes")


def _offer(nodes: list[NodeSpec], left: dict[str, int], overhead: int) -> list[NodeSpec]:
    """The nodes with the memory one more model may use: what is left, less its overhead."""
    return [replace(n, memory_bytes=max(0, left[n.node_id] - overhead)) for n in nodes]


def _left_out_reason(exc: Infeasible, nodes: list[NodeSpec], links: list, model: ModelSpec,
                     policy: Policy | None, overhead: int, before: list[str]) -> str:
    """Why ``model`` is left out: the planner's message and, when models are placed before
    it, whether it would fit alone (the whole pool, less its overhead) and how many more
    bytes they would have to leave (``Infeasible.shortfall_bytes``: enough, on the nodes
    its stages need it)."""
    if not before:
        return exc.message
    try:
        make_plan(_offer(nodes, {n.node_id: n.memory_bytes for n in nodes}, overhead), links, model, policy=policy)
    except Infeasible as alone:
        return f"{alone.message} (even without the models before it)"
    head = f"model {model.name!r} does not fit"
    msg = exc.message
    if msg.startswith(head):
        msg = f"{head} beside {', '.join(map(repr, before))}{msg[len(head):]}"
    return (f"{msg}. It fits on the whole pool: it would fit if the models before it left "
            f"{_fmt_bytes(exc.shortfall_bytes)} more on the nodes it needs")
